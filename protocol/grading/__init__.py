"""Grading of model answers for MATH-style problems (protocol section 3).

    >>> g = grade(r"... so the answer is $\\boxed{\\dfrac{13}{6}}$.", r"\\frac{13}{6}")
    >>> g.verdict, g.rule
    (True, 'boxed')

* `extract_answer(text)` finds the answer in a model output and says which rule fired
  (`protocol.grading.extract`); pure string work in the calling process.
* The comparison (`protocol.grading.equivalence.judge`) parses LaTeX without evaluating it and
  runs in a killable worker process under a hard wall-clock timeout and a memory cap
  (`protocol.grading.worker`).
* An answer must answer: a final that restates an expression of the problem (its text given in
  `problems`) is wrong however equal in value (`protocol.grading.restated`; `Grade.restated`).
* An output that ended at the token limit (`finish_reasons` "length") is graded only on an
  explicitly marked final (a box, "the final answer is ..."): no fallback rule reads it.
* A `Grade` has `verdict` True/False, or None with `reason` "no_answer" (nothing extracted),
  "timeout" (no verdict in time) or "unparsable" (the answer or reference cannot be read safely).
  For statistics None counts as wrong.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from protocol.grading import mathverify
from protocol.grading.extract import RULES, extract_answer, extract_final, find_boxes
from protocol.grading.normalize import MAX_ANSWER_CHARS
from protocol.grading.options import option_gold
from protocol.grading.restated import restates
from protocol.grading.spans import box_answer
from protocol.grading.worker import close_default_pool, default_pool

__all__ = ["Grade", "Opinion", "grade", "grade_many", "second_opinions", "extract_final",
           "extract_answer", "close_workers", "REASONS", "RULES", "GRADER_VERSION"]

REASONS = ("no_answer", "timeout", "unparsable")


def _source_digest() -> str:
    """sha256 of this package's sources (file names and bytes, in name order): the grader's version."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


#: The grader's version as records note it: a stored verdict is re-graded under it (`report`).
GRADER_VERSION = _source_digest()


@dataclass(frozen=True)
class Grade:
    """The grading of one output: `extracted` answer, `verdict`, `reason` when ungradable, and
    the extraction `rule` that fired."""

    extracted: str | None
    verdict: bool | None
    reason: str | None
    rule: str | None
    others: tuple[str, ...] = ()  # further answers the output also states as final
    restated: bool = False  # the answer copies an expression of the problem (`restated`)

    def as_record(self) -> dict:
        rec = {"extracted": self.extracted, "verdict": self.verdict, "reason": self.reason,
               "rule": self.rule}
        if self.others:
            rec["other_answers"] = list(self.others)
        if self.restated:
            rec["restated"] = True
        return rec


def _reference(gold: str) -> str:
    """The reference answer: MATH golds are bare LaTeX; a gold holding `\\boxed{}` (a full
    solution, or one box per value) is reduced to what its boxes state, read as in a model
    output: the last group of boxes ("\\boxed{1}, \\boxed{2}" is "1, 2"), named or labelled
    parts included."""
    if not isinstance(gold, str):
        raise TypeError(f"gold must be a string, got {type(gold).__name__}")
    boxes = find_boxes(gold)
    return box_answer(boxes, gold) if boxes else gold


def _check_timeout(timeout: float) -> float:
    t = float(timeout)
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return t


def grade_many(pairs: Iterable[tuple[str, str]], timeout: float = 5.0,
               workers: int = 2, problems: Sequence[str | None] | None = None,
               finish_reasons: Sequence[str | None] | None = None) -> list[Grade]:
    """Grade (pred_text, gold) pairs; `timeout` seconds per pair, `workers` processes in parallel.
    `problems` (one problem text or None per pair) lets a gold that names an option ("(C)") be
    matched by the option's content ("Plane") as well as by its letter (`options`), and an answer
    that restates the problem's own expression be refused (`restated`). `finish_reasons` (one per
    pair, as a run records it): "length" marks an output cut off at the token limit, graded only
    on an explicitly marked final."""
    timeout = _check_timeout(timeout)
    if int(workers) < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    pairs = list(pairs)
    problems = [None] * len(pairs) if problems is None else list(problems)
    if len(problems) != len(pairs):
        raise ValueError(f"{len(problems)} problems for {len(pairs)} pairs")
    finish_reasons = [None] * len(pairs) if finish_reasons is None else list(finish_reasons)
    if len(finish_reasons) != len(pairs):
        raise ValueError(f"{len(finish_reasons)} finish reasons for {len(pairs)} pairs")
    found = []
    for (pred, _), reason in zip(pairs, finish_reasons):
        if pred is not None and not isinstance(pred, str):
            raise TypeError(f"pred must be a string or None, got {type(pred).__name__}")
        found.append(extract_final(pred, truncated=reason == "length"))
    refs = [_reference(gold) for _, gold in pairs]
    choices = [option_gold(ref, problem) for ref, problem in zip(refs, problems)]
    # every answer the output states as final is judged; credit needs all of them right
    tasks, settled = [], {}
    for i, e in enumerate(found):
        for ans in (() if e.answer is None else (e.answer, *e.others)):
            ref = refs[i]
            if choices[i] is not None:  # an option: its letter or content, never a variable `c`
                decision = choices[i].decide(ans)
                if decision.compare_with is None:
                    settled[len(tasks)] = ("ok", decision.verdict, None)
                ref = decision.compare_with or ref
            if len(tasks) not in settled and len(ans) <= MAX_ANSWER_CHARS and restates(ans, ref, problems[i]):
                # a copy of the problem's expression is no answer, whatever its value
                settled[len(tasks)] = ("ok", False, "restated")
            if len(ans) > MAX_ANSWER_CHARS and len(tasks) not in settled:
                # answers too long to parse are settled here, without shipping megabytes to a worker
                settled[len(tasks)] = (("ok", True, None) if ans.strip() == ref.strip() else
                                       ("unparsable", None, "answer too long"))
            tasks.append((i, ans, ref))
    todo = [k for k in range(len(tasks)) if k not in settled]
    results = default_pool(int(workers)).run([tasks[k][1:] for k in todo],
                                             timeout, int(workers)) if todo else []
    by_task = dict(zip(todo, results))
    by_task.update(settled)
    per_item: dict[int, list[tuple]] = {}
    for k, (i, _, _) in enumerate(tasks):
        per_item.setdefault(i, []).append(by_task[k])
    out = []
    for i, e in enumerate(found):
        if e.answer is None:
            out.append(Grade(None, None, "no_answer", None))
            continue
        outcomes = per_item[i]
        if any(status == "ok" and verdict is False for status, verdict, _ in outcomes):
            copied = any(detail == "restated" for _, _, detail in outcomes)
            out.append(Grade(e.answer, False, None, e.rule, e.others, restated=copied))
        elif all(status == "ok" for status, _, _ in outcomes):
            out.append(Grade(e.answer, True, None, e.rule, e.others))
        else:
            status = next(s for s, _, _ in outcomes if s != "ok")
            out.append(Grade(e.answer, None, status, e.rule, e.others))
    return out


@dataclass(frozen=True)
class Opinion:
    """A second grader's verdict on one output: `verdict` True/False, or None with `reason`
    ("no_answer", "timeout", "unparsable")."""

    verdict: bool | None
    reason: str | None

    def as_record(self) -> dict:
        return {"verdict": self.verdict, "reason": self.reason}


def second_opinions(pairs: Iterable[tuple[str, str]], judge: str, timeout: float = 5.0,
                    workers: int = 2) -> list[Opinion]:
    """Grade (pred_text, gold) pairs with another grader (`judge`: "math-verify") in the same
    killable workers, under the same per-item `timeout`. The whole output goes to it: it
    extracts its own answer."""
    if judge != mathverify.NAME:
        raise ValueError(f"unknown grader {judge!r}; known: {mathverify.NAME}")
    if mathverify.version() is None:
        raise RuntimeError("math-verify is not installed (pip install 'retention[mathverify]')")
    timeout = _check_timeout(timeout)
    tasks = [(pred or "", _reference(gold)) for pred, gold in pairs]
    results = default_pool(int(workers)).run(tasks, timeout, int(workers), judge=judge) if tasks else []
    return [Opinion(verdict, None) if status == "ok" else Opinion(None, status)
            for status, verdict, _ in results]


def grade(pred_text: str, gold: str, timeout: float = 5.0, problem: str | None = None,
          finish_reason: str | None = None) -> Grade:
    """Grade one model output against the reference answer `gold` (of the problem text
    `problem`, when known: it lists the options of a multiple-choice problem and the expressions
    an answer must not merely restate); `finish_reason` "length": cut off at the token limit."""
    return grade_many([(pred_text, gold)], timeout=timeout, workers=1, problems=[problem],
                      finish_reasons=[finish_reason])[0]


def close_workers() -> None:
    """Stop the grading worker processes (they are also stopped at interpreter exit)."""
    close_default_pool()
