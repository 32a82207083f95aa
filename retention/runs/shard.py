"""Deterministic shards of a run: which (problem, sample) pairs shard I of N generates.

The rule (`RULE`, recorded in every shard's sidecar and in a merged `config.json`): the pairs of
a run are numbered in the order the run enumerates them, problem-major over the split's problem
order (`j = problem_index * samples + sample`), and pair j belongs to shard `j mod N`. Every pair
has exactly one shard, shard sizes differ by at most one, and the rule depends only on the
configuration (split, limit, samples), never on timing, so a shard killed and restarted owns the
same pairs. The shard index is not part of the configuration: shards of one run share its hash.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from protocol import shards as layout
from retention.errors import RetentionError

RULE = "pair j = problem_index * samples + sample belongs to shard j mod N (round-robin, v1)"
MAX_SHARDS = 100_000  # far above any cluster; refuses typos such as 1/10000000000


def shard_of(pair_index: int, count: int) -> int:
    """The shard that owns the pair numbered `pair_index` (the rule, in one place)."""
    return pair_index % count


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0 <= index < count)."""

    index: int
    count: int

    def __post_init__(self):
        if not (1 <= self.count <= MAX_SHARDS and 0 <= self.index < self.count):
            raise RetentionError(f"shard {self.index}/{self.count} is not I/N with 0 <= I < N <= {MAX_SHARDS}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, problem_index: int, sample: int, samples: int) -> bool:
        return shard_of(problem_index * samples + sample, self.count) == self.index

    @property
    def records_name(self) -> str:
        return layout.records_name(self.index, self.count)

    @property
    def trace_name(self) -> str:
        return layout.trace_name(self.index, self.count)

    @property
    def sidecar_name(self) -> str:
        return layout.sidecar_name(self.index, self.count)


def shard_pairs(n_problems: int, samples: int, shard: Shard | None) -> Iterator[tuple[int, int]]:
    """(problem_index, sample) pairs of a shard (all pairs for None), lazily, in run order."""
    for p in range(n_problems):
        for s in range(samples):
            if shard is None or shard.owns(p, s, samples):
                yield p, s


def shard_size(pairs: int, shard: Shard | None) -> int:
    """How many of `pairs` pairs (numbered 0..pairs-1) belong to `shard` (all of them for None)."""
    if shard is None:
        return pairs
    return max(0, (pairs - shard.index + shard.count - 1) // shard.count)


def parse_shard(text: str | None, env: Mapping[str, str] | None = None) -> Shard | None:
    """`I/N`, or `auto` for the launcher's environment: a Slurm array (`SLURM_ARRAY_TASK_ID`,
    `SLURM_ARRAY_TASK_COUNT`; the array must be indexed from 0, e.g. `--array=0-7`) or torchrun
    and similar launchers (`RANK`, `WORLD_SIZE`). None stays None (no sharding)."""
    if text is None:
        return None
    env = os.environ if env is None else env
    text = text.strip()
    if text == "auto":
        return _from_env(env)
    index, sep, count = text.partition("/")
    if not sep or not index.strip().isdigit() or not count.strip().isdigit():
        raise RetentionError(f"--shard: expected I/N (e.g. 0/4) or 'auto', got {text!r}")
    return Shard(int(index), int(count))


def _from_env(env: Mapping[str, str]) -> Shard:
    for idx_key, cnt_key in (("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"), ("RANK", "WORLD_SIZE")):
        if idx_key in env or cnt_key in env:
            idx, cnt = env.get(idx_key, ""), env.get(cnt_key, "")
            if not (idx.isdigit() and cnt.isdigit()):
                raise RetentionError(f"--shard auto: {idx_key}={idx!r} and {cnt_key}={cnt!r} must both be integers")
            if idx_key.startswith("SLURM") and int(idx) >= int(cnt):
                min_id = env.get("SLURM_ARRAY_TASK_MIN", "?")
                raise RetentionError(f"--shard auto: SLURM_ARRAY_TASK_ID {idx} >= SLURM_ARRAY_TASK_COUNT {cnt} "
                                     f"(array indexed from {min_id}); submit with --array=0-{int(cnt) - 1}")
            return Shard(int(idx), int(cnt))
    raise RetentionError("--shard auto: no SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT or RANK/WORLD_SIZE in the "
                         "environment; pass --shard I/N")


def write_sidecar(run_dir: Path, shard: Shard, code_version: str, manifest_sha256: str | None) -> None:
    """Describe the shard that writes into `run_dir`: what merge checks (code version, split
    manifest) and where it runs (host, pid: updated on every start, so a retried shard shows its
    new process). A shard resumed by different code is refused: one shard, one code version."""
    path = Path(run_dir) / shard.sidecar_name
    info = {"shard": str(shard), "index": shard.index, "count": shard.count, "rule": RULE,
            "code_version": code_version, "split_manifest_sha256": manifest_sha256}
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            raise RetentionError(f"{path}: unreadable shard description") from None
        for key in ("code_version", "split_manifest_sha256", "rule"):
            if old.get(key) != info[key]:
                raise RetentionError(f"shard {shard} in {run_dir} was started with {key} {old.get(key)!r}, "
                                     f"this is {info[key]!r}: finish it with the code and splits it began with")
        info["started"] = old.get("started")
    else:
        info["started"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    info.update(host=socket.gethostname(), pid=os.getpid())
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
