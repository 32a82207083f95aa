#!/usr/bin/env python
"""How much of a run's slot-steps its tail wastes, and whether ordering the work would win it back.

    python scripts/tail_simulation.py RECORDS.jsonl... [--slots 64] [--data ../shared/data/math500.jsonl]

The engine's decode step runs at a fixed slot count S (a record is then the same whatever shares its
batch); a slot that frees takes the next pending request, and the run ends when the last answer
does. Given the output lengths a run really produced, this replays that schedule (each slot busy
for its answer's length) for several orders of the same requests and prints the share of slot-steps
that decoded a real token (tokens / (S x steps)):

* `fifo`: the order the runner uses (the order of the records file);
* `by prompt`, `by level`: longest prompt first, hardest MATH level first (`--data`), predictors a
  runner has before decoding;
* `by <run>`: longest first by the lengths another run of the same (problem, sample)s produced, for
  every other file given with the same pairs (a run's sibling arms);
* `oracle`: longest first by the true lengths (what no runner can know).

A record does not depend on the order (per-request seeds, the static step), so only the time does.
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path


def steps(lengths: list[int], slots: int) -> int:
    """Decode steps of a run whose `slots` slots take requests of the given lengths in order."""
    free = [0] * slots
    end = 0
    for n in lengths:
        t = heapq.heappop(free) + n
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def share(order: list[dict], slots: int) -> float:
    lengths = [int(r["output_tokens"]) for r in order]
    return sum(lengths) / (steps(lengths, slots) * slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--slots", type=int, default=None, help="slot count [default: the records' `slots`]")
    ap.add_argument("--data", type=Path, default=None, help="MATH-500 jsonl with `level`, for `by level`")
    args = ap.parse_args()
    level = {}
    if args.data is not None:
        level = {r["unique_id"]: int(r.get("level") or 0) for r in map(json.loads, args.data.open())}
    runs = {f: [json.loads(line) for line in f.open() if line.strip()] for f in args.records}
    for f, recs in runs.items():
        S = args.slots or int(recs[0].get("slots") or 1)
        key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
        row = {"fifo": share(recs, S),
               "by prompt": share(sorted(recs, key=lambda r: -r["prompt_tokens"]), S)}
        if level:
            row["by level"] = share(sorted(recs, key=lambda r: -level.get(r["problem_id"], 0)), S)
        for g, other in runs.items():
            lengths = {key(r): r["output_tokens"] for r in other}
            if g != f and set(lengths) == {key(r) for r in recs}:
                row[f"by {g.parent.name}"] = share(sorted(recs, key=lambda r: -lengths[key(r)]), S)
        row["oracle"] = share(sorted(recs, key=lambda r: -r["output_tokens"]), S)
        figures = ", ".join(f"{k} {v:.0%}" for k, v in row.items())
        print(f"{f.parent.name} ({len(recs)} records, {S} slots): {figures}")


if __name__ == "__main__":
    main()
