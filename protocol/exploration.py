"""The exploration registry: which problems of a confirm set were already looked at.

MATH-500 explores on its dev split and confirms on a disjoint split. The AIME sets have no dev split
(30 problems each), so `retention run --dataset aime24` explores the very problems a plan may later
confirm on. Every such run is remembered here, per user, so that the report can flag a confirmation
on an explored set ("confirm set seen during exploration"); nothing is refused.

One JSONL file per dataset: `<state dir>/explored/<dataset>.jsonl` (`protocol.ledger.state_dir`,
`$RETENTION_STATE_DIR` overrides it), one line per exploration:
`{"dataset", "problem_ids", "time", "config_hashes"}` (the runs' configuration hashes, when known). Appends are single `write` calls of one line
(`O_APPEND`), so concurrent runs do not interleave; a torn last line (a killed process) is skipped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from protocol.data import DATASETS
from protocol.errors import ProtocolError
from protocol.ledger import state_dir

SUBDIR = "explored"


def registry_path(dataset: str) -> Path:
    """The exploration log of `dataset`."""
    if dataset not in DATASETS:
        raise ProtocolError(f"unknown dataset {dataset!r} (expected one of {', '.join(DATASETS)})")
    return state_dir() / SUBDIR / f"{dataset}.jsonl"


def record_exploration(dataset: str, problem_ids: list[str], config_hashes: list[str] | None = None) -> dict[str, Any]:
    """Append one exploration of `problem_ids` of `dataset` to the registry; returns the entry."""
    if not problem_ids or not all(isinstance(p, str) and p for p in problem_ids):
        raise ProtocolError("an exploration records a non-empty list of problem ids")
    entry = {"dataset": dataset, "problem_ids": list(problem_ids),
             "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config_hashes": list(config_hashes or [])}
    path = registry_path(dataset)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(entry) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # after a torn line, start a fresh one rather than extend it
        os.write(fd, line)
    finally:
        os.close(fd)
    return entry


def explored(dataset: str) -> list[dict[str, Any]]:
    """Every recorded exploration of `dataset`, oldest first ([] when none)."""
    path = registry_path(dataset)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a torn line of a killed run: it recorded nothing usable
        if isinstance(entry, dict) and isinstance(entry.get("problem_ids"), list):
            entries.append(entry)
    return entries


def explored_ids(dataset: str) -> set[str]:
    """The ids of `dataset` seen in any exploration."""
    return {pid for entry in explored(dataset) for pid in entry["problem_ids"] if isinstance(pid, str)}
