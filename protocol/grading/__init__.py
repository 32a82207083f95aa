"""Grading of model answers for MATH-style problems (protocol section 3).

    >>> g = grade(r"... so the answer is $\\boxed{\\dfrac{13}{6}}$.", r"\\frac{13}{6}")
    >>> g.verdict, g.rule
    (True, 'boxed')

* `extract_answer(text)` finds the answer in a model output and says which rule fired
  (`protocol.grading.extract`); pure string work in the calling process.
* The comparison (`protocol.grading.equivalence.judge`) parses LaTeX without evaluating it and
  runs in a killable worker process under a hard wall-clock timeout and a memory cap
  (`protocol.grading.worker`).
* A `Grade` has `verdict` True/False, or None with `reason` "no_answer" (nothing extracted),
  "timeout" (no verdict in time) or "unparsable" (the answer or reference cannot be read safely).
  For statistics None counts as wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from protocol.grading.extract import RULES, extract_answer, find_boxes
from protocol.grading.normalize import MAX_ANSWER_CHARS

__all__ = ["Grade", "grade", "grade_many", "extract_answer", "close_workers", "REASONS", "RULES"]

REASONS = ("no_answer", "timeout", "unparsable")


@dataclass(frozen=True)
class Grade:
    """The grading of one output: `extracted` answer, `verdict`, `reason` when ungradable, and
    the extraction `rule` that fired."""

    extracted: str | None
    verdict: bool | None
    reason: str | None
    rule: str | None

    def as_record(self) -> dict:
        return {"extracted": self.extracted, "verdict": self.verdict, "reason": self.reason,
                "rule": self.rule}


def _reference(gold: str) -> str:
    """The reference answer: MATH golds are bare LaTeX; a gold holding `\\boxed{}` (a full
    solution) is reduced to its last box."""
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a string, got {type(gold).__name__}")
    boxes = find_boxes(gold)
    return boxes[-1][2] if boxes else gold


def _check_timeout(timeout: float) -> float:
    t = float(timeout)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return t


def grade_many(pairs: Iterable[tuple[str, str]], timeout: float = 5.0,
               workers: int = 2) -> list[Grade]:
    """Grade (pred_text, gold) pairs; `timeout` seconds per pair, `workers` processes in parallel."""
    from protocol.grading.worker import default_pool

    timeout = _check_timeout(timeout)
    if int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    pairs = list(pairs)
    extracted = []
    for pred, gold in pairs:
        if pred is not None and not isinstance(pred, str):
            raise TypeError(f"pred must be a string or None, got {type(pred).__name__}")
        extracted.append(extract_answer(pred))
    refs = [_reference(gold) for _, gold in pairs]
    # answers too long to parse are settled here, without shipping megabytes to a worker
    settled = {i: (("ok", True, None) if ans.strip() == refs[i].strip() else
                   ("unparsable", None, "answer too long"))
               for i, (ans, _) in enumerate(extracted)
               if ans is not None and len(ans) > MAX_ANSWER_CHARS}
    todo = [i for i, (ans, _) in enumerate(extracted) if ans is not None and i not in settled]
    results = default_pool(int(workers)).run([(extracted[i][0], refs[i]) for i in todo],
                                             timeout, int(workers)) if todo else []
    by_index = dict(zip(todo, results))
    by_index.update(settled)
    out = []
    for i, (ans, rule) in enumerate(extracted):
        if ans is None:
            out.append(Grade(None, None, "no_answer", None))
            continue
        status, verdict, _detail = by_index[i]
        if status == "ok":
            out.append(Grade(ans, verdict, None, rule))
        else:
            out.append(Grade(ans, None, status, rule))
    return out


def grade(pred_text: str, gold: str, timeout: float = 5.0) -> Grade:
    """Grade one model output against the reference answer `gold`."""
    return grade_many([(pred_text, gold)], timeout=timeout, workers=1)[0]


def close_workers() -> None:
    """Stop the grading worker processes (they are also stopped at interpreter exit)."""
    from protocol.grading.worker import close_default_pool

    close_default_pool()
