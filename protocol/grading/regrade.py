"""Re-grade the records of finished runs with the current grader, and say which verdicts changed.

    python -m protocol.grading.regrade [--data MATH500.jsonl] [--write] RUN_DIR_OR_FOLDER ...

Every record with `text` and `gold` is graded again, with its problem's text (looked up by
`problem_id` in the MATH-500 copy: it lists a multiple-choice problem's options and the expressions
an answer must not merely restate) and its `finish_reason` (a "length" record is graded on a
marked final only). Each changed
verdict is printed as ``RUN_DIR PROBLEM_ID sample S: OLD -> NEW (extracted ...)``; with `--write`, the
changed records get the new `extracted`/`verdict`/`reason`/`rule`/`other_answers`/`restated` and
the `grader_version` that gave them, and every other
line of the file stays byte for byte as it was (the file is replaced atomically). Without
`--write` nothing is written. Reports read the stored verdicts, so regenerate them afterwards.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from protocol.errors import ProtocolError
from protocol.grading import GRADER_VERSION, grade_many
from protocol.io import dumps, loads, read_text, write_atomic
from protocol.runs import find_run_dirs
from protocol.shards import record_files
from protocol.splits import problems_by_id

__all__ = ["Change", "regrade_file", "main"]

_GRADE_KEYS = ("extracted", "verdict", "reason", "rule", "other_answers", "restated")


@dataclass(frozen=True)
class Change:
    """One record whose verdict the current grader changes."""

    path: Path
    problem_id: str
    sample: int
    old: bool | None
    new: bool | None
    extracted: str | None


def regrade_file(path: Path, problems: dict, write: bool, timeout: float = 5.0,
                 workers: int = 2) -> list[Change]:
    """Re-grade the records of one `records.jsonl`; `problems`: problem_id -> problem text.
    Returns the changed verdicts; with `write`, stores every changed grade (a new `extracted` or
    `rule` too; other lines untouched)."""
    lines = read_text(path, "records").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        raise ProtocolError(f"{path}: the last line is half-written; finish or repair the run first")
    todo = []  # (line index, record)
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        rec = loads(line, where=f"{path}:{n + 1}")
        if not isinstance(rec, dict):
            raise ProtocolError(f"{path}:{n + 1}: not a JSON object")
        if isinstance(rec.get("text"), str) and isinstance(rec.get("gold"), str):
            todo.append((n, rec))
    grades = grade_many([(r["text"], r["gold"]) for _, r in todo], timeout=timeout, workers=workers,
                        problems=[problems.get(str(r.get("problem_id"))) for _, r in todo],
                        finish_reasons=[r.get("finish_reason") for _, r in todo])
    changes, touched = [], False
    for (n, rec), g in zip(todo, grades):
        new = g.as_record()
        if all(rec.get(k) == new.get(k) for k in _GRADE_KEYS):
            continue
        if rec.get("verdict") != g.verdict:
            changes.append(Change(path, str(rec.get("problem_id")), int(rec.get("sample", 0)),
                                  rec.get("verdict"), g.verdict, g.extracted))
        rec.pop("other_answers", None)
        rec.pop("restated", None)
        rec.update(new, grader_version=GRADER_VERSION)
        lines[n] = dumps(rec) + "\n"
        touched = True
    if write and touched:
        write_atomic(path, "".join(lines))
    return changes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol.grading.regrade", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, or folders holding them")
    parser.add_argument("--data", type=Path, default=None, help="MATH-500 JSONL (default: the shipped copy)")
    parser.add_argument("--write", action="store_true", help="store the changed verdicts in the records")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per answer (default 5)")
    args = parser.parse_args(argv)
    try:
        problems = {pid: p.problem for pid, p in problems_by_id(args.data).items()}
        changes, files = [], 0
        for run in find_run_dirs(args.runs):
            for path in record_files(run):
                files += 1
                changes += regrade_file(path, problems, args.write, timeout=args.timeout)
    except (ProtocolError, ValueError) as exc:  # ValueError: a timeout that is not a positive number
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for c in changes:
        print(f"{c.path.parent} {c.problem_id} sample {c.sample}: {c.old} -> {c.new} "
              f"(extracted {c.extracted!r})")
    verb = "written" if args.write else "not written (use --write)"
    print(f"{files} record files, {len(changes)} changed verdicts, {verb}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
