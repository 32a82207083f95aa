"""Scan: does the grader credit a problem's own expression, boxed, as the answer?

    python -m protocol.grading.scan_restated [--data MATH500.jsonl] [--show]

The problems scanned are those that ask to evaluate, compute, simplify or find an expression they
write out: an imperative ("Evaluate", "Compute", "Simplify", "Find", "Calculate", any case) followed
within two words by a math span (``Compute $\\dbinom{8}{4}$.``, ``Find the value of $...$``), and
that span is the expression restated. Each is graded as ``\\boxed{<expression>}`` against the
problem's reference twice: without the problem text (the grader before the restatement rule: it
judges value only) and with it (the rule in force). Prints the accepted count of each; `--show`
lists the problems accepted without the rule.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import ProtocolError
from protocol.grading import grade_many
from protocol.grading.spans import math_spans
from protocol.splits import problems_by_id

__all__ = ["Target", "targets", "scan", "main"]

_ASK = re.compile(r"(?i)\b(?:evaluate|compute|simplify|find|calculate)\b:?(?:\s+[A-Za-z]+,?){0,2}\s*:?\s*$")


@dataclass(frozen=True)
class Target:
    """One scanned problem: its id, text, reference answer and the expression it asks about."""

    problem_id: str
    problem: str
    gold: str
    expression: str


def targets(problems) -> list[Target]:
    """The problems that ask about an expression they write out (module doc), in data order."""
    out = []
    for p in problems:
        for start, _end, content in math_spans(p.problem):
            if _ASK.search(p.problem[max(0, start - 60):start]) and content.strip():
                out.append(Target(p.unique_id, p.problem, p.answer, content.strip().rstrip(".,")))
                break
    return out


def scan(items: list[Target], timeout: float = 5.0, workers: int = 2) -> tuple[list[bool], list[bool]]:
    """Per target: (accepted without the problem text, accepted with it)."""
    pairs = [(f"The answer is $\\boxed{{{t.expression}}}$.", t.gold) for t in items]
    before = grade_many(pairs, timeout=timeout, workers=workers)
    after = grade_many(pairs, timeout=timeout, workers=workers, problems=[t.problem for t in items])
    return [g.verdict is True for g in before], [g.verdict is True for g in after]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol.grading.scan_restated",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=None, help="MATH-500 JSONL (default: the shipped copy)")
    parser.add_argument("--split", type=Path, default=None,
                        help="a file of problem ids, one per line: count those too")
    parser.add_argument("--show", action="store_true", help="list the problems accepted without the rule")
    args = parser.parse_args(argv)
    try:
        items = targets(problems_by_id(args.data).values())
        subset = set(args.split.read_text().split()) if args.split else None
    except (ProtocolError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    before, after = scan(items)
    for t, b, a in zip(items, before, after):
        if args.show and b:
            print(f"{t.problem_id}: {t.expression!r} -> {'accepted' if a else 'refused'} with the rule")
    print(f"restated expression accepted: {sum(before)} of {len(items)} without the rule, "
          f"{sum(after)} of {len(items)} with it")
    if subset is not None:
        keep = [k for k, t in enumerate(items) if t.problem_id in subset]
        print(f"  of which in {args.split.name}: {sum(before[k] for k in keep)} of {len(keep)} without, "
              f"{sum(after[k] for k in keep)} of {len(keep)} with")
    return 0


if __name__ == "__main__":
    sys.exit(main())
