"""Multiple-choice answers (`protocol.grading.options`): a gold that names an option matches the
same option only, by its letter in any usual spelling or by the option's content; never another
letter, and never a lower-case variable that shares the letter. The labelled corpus is
`grading_corpus/options.jsonl` (each pair carries the problem text that lists the options)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.grading import grade, grade_many
from protocol.grading.options import named_letters, option_gold, options_of

CORPUS = Path(__file__).resolve().parent / "grading_corpus" / "options.jsonl"
DATA = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "math500.jsonl"
TIMEOUT = 10.0
SHAPES = ("For a constant $c,$ in cylindrical coordinates $(r,\\theta,z),$ find the shape described by "
          "the equation\n\\[z = c.\\](A) Line\n(B) Circle\n(C) Plane\n(D) Sphere\n(E) Cylinder\n(F) Cone\n\n"
          "Enter the letter of the correct option.")


def _rows() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_option_corpus_shape():
    rows = _rows()
    assert len(rows) >= 40
    assert sum(not r["expected"] for r in rows) * 2 >= len(rows)  # at least half must not match
    assert all(set(r) == {"pred", "gold", "problem", "expected", "category", "style", "variant"} for r in rows)
    assert len({(r["pred"], r["gold"], r["problem"]) for r in rows}) == len(rows)
    # the reported false positive is in it: the constant `c` boxed against the option (C)
    assert any(r["style"] == "variable" and "boxed{c}" in r["pred"] and not r["expected"] for r in rows)


def test_option_corpus_agrees_with_no_false_positive():
    rows = _rows()
    grades = grade_many([(r["pred"], r["gold"]) for r in rows], timeout=TIMEOUT,
                        problems=[r["problem"] for r in rows])
    wrong = [(r, g) for r, g in zip(rows, grades) if (g.verdict is True) != r["expected"]]
    for r, g in wrong:
        print(f"  [{r['style']}] expected {r['expected']}, got {g.verdict}; extracted {g.extracted!r}")
    assert not [1 for r, g in wrong if g.verdict is True]
    assert not wrong


def test_options_are_read_from_the_problem():
    assert options_of(SHAPES) == {"A": "Line", "B": "Circle", "C": "Plane", "D": "Sphere",
                                  "E": "Cylinder", "F": "Cone"}
    amc = ("$\\textbf{(A)}\\ 3(1 + r)^x = 7\\qquad \\textbf{(B)}\\ 3(1 + r/10)^x = 7$")
    assert options_of(amc) == {"A": "3(1 + r)^x = 7", "B": "3(1 + r/10)^x = 7"}
    assert options_of("Part (A) asks for the area.") == {}      # one label is no option list
    assert options_of("(B) Circle (C) Plane") == {}             # labels must start at (A)
    assert options_of(None) == {}


@pytest.mark.parametrize("gold, problem, letters", [
    ("\\text{(C)}", None, ("C",)), ("(C)", None, ("C",)), ("\\textbf{(C)}", None, ("C",)),
    ("C) Plane", None, ("C",)), ("\\text{(C) Plane}", None, ("C",)), ("C", SHAPES, ("C",)),
    ("\\text{A, C}", SHAPES, ("A", "C")),
    ("C", None, None),          # a bare letter without options may be a point's name
    ("c", SHAPES, None), ("(c)", None, None), ("12", SHAPES, None), ("\\text{Plane}", SHAPES, None),
])
def test_which_golds_are_options(gold, problem, letters):
    got = option_gold(gold, problem)
    assert (got.letters if got else None) == letters


@pytest.mark.parametrize("answer, letters", [
    ("C", ("C",)), ("(C)", ("C",)), ("\\text{(C)}", ("C",)), ("\\textbf{(C)}", ("C",)),
    ("C) Plane", ("C",)), ("C.", ("C",)), ("option C", ("C",)), ("(c)", ("C",)), ("c) Plane", ("C",)),
    ("option c", ("C",)), ("A, C", ("A", "C")), ("(C) Line", ()),
    ("c", None), ("c.", None), ("z = c", None), ("c^2", None), ("Plane", None), ("3", None),
])
def test_letters_an_answer_names(answer, letters):
    assert named_letters(answer, options_of(SHAPES)) == letters


def test_the_committed_false_positive_is_wrong_with_or_without_the_problem():
    text = ("5. **Conclusion**: The direction vector of the line is \\(c\\).\n\n"
            "Therefore, the direction vector of the line is \\(\\boxed{c}\\).")
    assert grade(text, "\\text{(C)}", timeout=TIMEOUT, problem=SHAPES).verdict is False
    assert grade(text, "\\text{(C)}", timeout=TIMEOUT).verdict is False
    assert grade("\\boxed{C}", "\\text{(C)}", timeout=TIMEOUT).verdict is True


def test_content_needs_the_problem():
    assert grade("\\boxed{\\text{Plane}}", "\\text{(C)}", timeout=TIMEOUT, problem=SHAPES).verdict is True
    assert grade("\\boxed{\\text{Plane}}", "\\text{(C)}", timeout=TIMEOUT).verdict is False
    assert grade("\\boxed{\\text{Plane}}", "(C) Plane", timeout=TIMEOUT).verdict is True


def test_non_option_golds_are_unchanged():
    got = grade_many([("\\boxed{c}", "c"), ("\\boxed{C}", "C"), ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
                      ("\\boxed{5}", "5")], timeout=TIMEOUT, problems=[SHAPES, None, SHAPES, SHAPES])
    assert [g.verdict for g in got] == [True, True, True, True]


def test_problems_must_match_the_pairs():
    with pytest.raises(ValueError, match="problems"):
        grade_many([("1", "1")], problems=[None, None])


@pytest.mark.skipif(not DATA.is_file(), reason="needs ../shared/data/math500.jsonl")
def test_math500_option_golds_credit_their_own_solutions():
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    opts = [r for r in rows if option_gold(r["answer"], r["problem"]) is not None]
    assert len(opts) >= 3
    got = grade_many([(r["solution"], r["answer"]) for r in opts], timeout=TIMEOUT,
                     problems=[r["problem"] for r in opts])
    assert all(g.verdict is True for g in got)
