"""The arm of cell 2 of the 1.5B confirmation (issue 44, item 5), by the rule written in cell 1's plan note
(`results/confirm-qwen1.5b/`, plan 6dd9fd53c759) before the confirm split was touched:

    the arm with the highest dev accuracy on the 128 dev problems among the sweep's matched-memory arms
    (every arm but full, random-pp itself and the keep-on-top prompt arms, whose memory is b plus the
    prompt), ties to the higher acc_strict, then to the earlier arm of the sweep's order.

The sweep's order is the order the arms ran (each run's `created`). Prints every candidate, best first, then
the chosen arm; refuses, in one line, while the sweep has fewer arms than `--expect` (17: the rule speaks of
the complete sweep).

    python scripts/best_dev_arm.py results/design-space-qwen1.5b/runs
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from protocol.diagnostics import sceptic_diagnostics, summarize_run
from protocol.runs import assign_labels, find_run_dirs, load_run


@dataclass(frozen=True)
class Candidate:
    label: str
    scorer: str
    prompt_rule: str
    correct: int
    strict: int  # correct and finished within the token limit
    created: str  # ISO time the run started: the sweep's order
    path: str


def eligible(c: Candidate) -> bool:
    """A matched-memory arm other than the control: not the full cache, not random-pp, not keep-on-top."""
    return c.scorer not in ("full", "random-pp") and c.prompt_rule != "keep-on-top"


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    """The eligible arms, best first: more correct, then more strictly correct, then earlier in the sweep."""
    return sorted(filter(eligible, candidates), key=lambda c: (-c.correct, -c.strict, c.created))


def candidates(folder: Path) -> list[Candidate]:
    runs = [load_run(d) for d in find_run_dirs([folder])]
    assign_labels(runs)
    out = []
    for run in runs:
        s, d = summarize_run(run), sceptic_diagnostics(run)  # the tables' own accuracy and acc_strict
        n = s["n_records"]
        out.append(Candidate(run.label, run.scorer, run.prompt_rule, round(s["accuracy"] * n),
                             round(d["acc_strict"] * n), str(run.meta.get("created", "")), str(run.path)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--expect", type=int, default=17, help="arms of the complete sweep (default 17)")
    args = ap.parse_args(argv)
    if not args.runs.is_dir():
        sys.exit(f"best_dev_arm: {args.runs} is not a folder of runs")
    found = candidates(args.runs)
    if len(found) < args.expect:
        sys.exit(f"best_dev_arm: the sweep has {len(found)} of {args.expect} arms; the rule is applied to the "
                 "complete sweep")
    order = ranked(found)
    for c in order:
        print(f"{c.label:<40} {c.correct:>3} correct, {c.strict:>3} strictly  (ran {c.created})")
    print(f"chosen: {order[0].label} ({order[0].path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
