"""Stored verdicts checked against a re-grade of their text, for `report`.

A report counts the verdicts stored in the records. A verdict set to true by hand (or by an older
grader) would count as it stands; so before a report is built every record that has a text, a
reference and a stored grade is graded again, with its problem's text and its finish reason, as
`run` grades. A record whose stored verdict differs is marked (`VERDICT_CHECK` = "differs") and
each run gets one note naming the records: under the grader version the record notes
(`grader_version`, `protocol.grading.GRADER_VERSION`) the difference can only be an edit; under
another version, or none noted, it may be a change of the grading rules (`regrade` stores the new
verdicts).
"""

from __future__ import annotations

from protocol import grading

__all__ = ["check_verdicts", "VERDICT_CHECK"]

#: Key added to a record whose stored verdict differs from a re-grade of its text.
VERDICT_CHECK = "verdict_check"
_SHOWN = 5


def check_verdicts(runs, problems: dict[str, str], grade_many=grading.grade_many) -> list[str]:
    """Re-grade every graded record of `runs` (objects with `.path` and `.records`); `problems`:
    problem_id -> problem text. Marks the records whose stored verdict differs and returns one
    note per run that has any."""
    todo = [(run, rec) for run in runs for rec in run.records
            if isinstance(rec.get("text"), str) and isinstance(rec.get("gold"), str)
            and any(rec.get(k) is not None for k in ("verdict", "reason", "rule"))]
    if not todo:
        return []
    grades = grade_many([(rec["text"], rec["gold"]) for _, rec in todo],
                        problems=[problems.get(str(rec.get("problem_id"))) for _, rec in todo],
                        finish_reasons=[rec.get("finish_reason") for _, rec in todo])
    found: dict[int, list[tuple[dict, object]]] = {}
    for (run, rec), g in zip(todo, grades):
        if (rec.get("verdict") is True) != (g.verdict is True):
            rec[VERDICT_CHECK] = "differs"
            found.setdefault(id(run), []).append((rec, g.verdict))
    notes = []
    for run in runs:
        bad = found.get(id(run), [])
        if not bad:
            continue
        same = [r for r, _ in bad if r.get("grader_version") == grading.GRADER_VERSION]
        shown = ", ".join(f"{r.get('problem_id')} sample {r.get('sample')} (stored {r.get('verdict')}, "
                          f"re-graded {v})" for r, v in bad[:_SHOWN])
        more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        why = (f"{len(same)} under the grader version they record ({grading.GRADER_VERSION}): edited; "
               f"{len(bad) - len(same)} under another or none: the rules may have changed (regrade them)")
        notes.append(f"VERDICTS {run.path.name}: {len(bad)} record(s) whose stored verdict differs from a "
                     f"re-grade of their text ({why}): {shown}{more}")
    return notes
