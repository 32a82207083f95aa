"""File layout of sharded run directories: which files hold a run's records.

A run cut into N shards keeps one run directory (one configuration, one `config.json`); shard I of
N appends its records to `records.shard-I-of-N.jsonl`, its traces to `trace.shard-I-of-N.jsonl`
and describes itself (code version, split manifest, host) in `shard-I-of-N.json`. An unsharded or
merged run has a single `records.jsonl`. This module only names and finds those files, so that
`protocol.report` reads a sharded directory without importing the runtime.
"""

from __future__ import annotations

import re
from pathlib import Path

RECORDS = "records.jsonl"
TRACE = "trace.jsonl"
_SHARD_RE = re.compile(r"^records\.shard-(\d+)-of-(\d+)\.jsonl$")


def records_name(index: int, count: int) -> str:
    return f"records.shard-{index}-of-{count}.jsonl"


def trace_name(index: int, count: int) -> str:
    return f"trace.shard-{index}-of-{count}.jsonl"


def sidecar_name(index: int, count: int) -> str:
    return f"shard-{index}-of-{count}.json"


def shard_record_files(run_dir: Path) -> dict[tuple[int, int], Path]:
    """{(index, count): records file} of the shards found directly in `run_dir`, sorted."""
    found = {}
    for p in Path(run_dir).glob("records.shard-*-of-*.jsonl"):
        m = _SHARD_RE.match(p.name)
        if m:
            found[(int(m.group(1)), int(m.group(2)))] = p
    return dict(sorted(found.items()))


def record_files(run_dir: Path) -> list[Path]:
    """The files holding a run's records: `records.jsonl` when present (unsharded or merged),
    else every shard's records file; empty when the directory holds no records file."""
    single = Path(run_dir) / RECORDS
    if single.is_file():
        return [single]
    return list(shard_record_files(run_dir).values())


def trace_files(run_dir: Path) -> list[Path]:
    """The trace files that go with `record_files(run_dir)` (those that exist)."""
    if (Path(run_dir) / RECORDS).is_file():
        return [p for p in [Path(run_dir) / TRACE] if p.is_file()]
    return [p for (i, n) in shard_record_files(run_dir) if (p := Path(run_dir) / trace_name(i, n)).is_file()]


def missing_shards(run_dir: Path) -> list[str]:
    """`I/N` of the shards a sharded directory lacks (empty for an unsharded one)."""
    keys = shard_record_files(run_dir) if not (Path(run_dir) / RECORDS).is_file() else {}
    counts = {n for _i, n in keys}
    return [f"{i}/{n}" for n in sorted(counts) for i in range(n) if (i, n) not in keys]
