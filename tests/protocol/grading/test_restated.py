"""An answer must answer (restating the problem's expression earns nothing) and a cut-off output
is graded on a marked final only (docs/grading.md, "An answer must answer", "Cut-off outputs")."""

import json
import os
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from protocol.grading import grade, grade_many
from protocol.grading.restated import chooses, restates, settled, shape
from protocol.grading.scan_restated import scan, targets
from protocol.splits import problems_by_id

P742 = ("Evaluate\n\\[\\sin (\\arcsin 0.4 + \\arcsin 0.5) \\cdot \\sin (\\arcsin 0.5 - \\arcsin 0.4).\\]")
EXPR742 = "\\sin (\\arcsin 0.4 + \\arcsin 0.5) \\cdot \\sin (\\arcsin 0.5 - \\arcsin 0.4)"

# (problem, gold, answer, credited)
CASES = [
    # restated: the problem's own expression, however spelled, is no answer
    (P742, "\\frac{9}{100}", EXPR742, False),
    (P742, "\\frac{9}{100}", "\\sin(\\arcsin 0.4+\\arcsin 0.5)\\times\\sin(\\arcsin 0.5-\\arcsin 0.4)", False),
    (P742, "\\frac{9}{100}", "\\sin\\left(\\arcsin 0.4+\\arcsin 0.5\\right)\\sin\\left(\\arcsin 0.5-\\arcsin 0.4\\right)".replace(
        "\\sin\\left(\\arcsin 0.5", "\\cdot\\sin\\left(\\arcsin 0.5"), False),
    (P742, "\\frac{9}{100}", "\\sin(\\arcsin(0.4)+\\arcsin(0.5))\\sin(\\arcsin(0.5)-\\arcsin(0.4))", False),
    ("Compute $2 \\cdot 3 \\cdot 4$.", "24", "2\\times 3\\times 4", False),
    ("Compute $2 \\cdot 3 \\cdot 4$.", "24", "24", True),
    ("Simplify $\\sqrt{242}$.", "11\\sqrt2", "\\sqrt{242}", False),
    ("Simplify $\\sqrt{242}$.", "11\\sqrt2", "x = \\sqrt{242}", False),
    ("Compute $\\dbinom{31}{28}$.", "4495", "\\binom{31}{28}", False),
    ("Simplify $\\frac{24}{36}$.", "\\frac{2}{3}", "\\dfrac{24}{36}", False),
    ("What is $99^2+99+1$?", "9901", "99^{2}+99+1", False),
    ("Expand $(x+2)(x+3)$.", "x^2+5x+6", "(x+2)(x+3)", False),
    ("Factor $x^2+5x+6$.", "(x+2)(x+3)", "x^2 + 5x + 6", False),
    # evaluated or simplified equivalents still answer
    (P742, "\\frac{9}{100}", "\\frac{9}{100}", True),
    (P742, "\\frac{9}{100}", "0.09", True),
    (P742, "\\frac{9}{100}", "\\dfrac{9}{100}", True),
    ("Simplify $\\sqrt{242}$.", "11\\sqrt2", "11\\sqrt{2}", True),
    ("Simplify $\\sqrt{242}$.", "11\\sqrt2", "\\sqrt{242} = 11\\sqrt{2}", True),
    ("Simplify $\\sqrt{242}$.", "11\\sqrt2", "11\\sqrt{2} = \\sqrt{242}", True),
    (P742, "\\frac{9}{100}", "\\frac{9}{100} = " + EXPR742, True),
    ("Simplify $\\frac{24}{36}$.", "\\frac{2}{3}", "\\frac{2}{3}", True),
    ("Expand $(x+2)(x+3)$.", "x^2+5x+6", "x^2+5x+6", True),
    # the reference written in the problem is an answer, given values too
    ("Simplify $(x+1)^2 - x^2 - x$; is it $x+1$?", "x+1", "x+1", True),
    ("If $a = 5$ and $b = a^2$, what is $b - 4a$?", "5", "5", True),
    ("Let $\\theta = \\frac{\\pi}{7}$. Find the smallest positive angle equal to $8\\theta - \\pi$.",
     "\\frac{\\pi}{7}", "\\frac{\\pi}{7}", True),
    ("Given $x = \\sqrt{2}$, find $x^3 / x^2$.", "\\sqrt{2}", "\\sqrt{2}", True),
    # choosing among expressions the problem gives is an answer
    ("Which is larger, $2^{10}$ or $10^3$?", "1024", "2^{10}", True),
    ("Which of the following is equal to $\\frac{1}{2}$? (A) $\\frac{2}{4}$ (B) $\\frac{3}{4}$",
     "\\frac{2}{4}", "\\frac{2}{4}", True),
]


@pytest.mark.parametrize("problem,gold,answer,credited", CASES)
def test_restated_expressions_earn_nothing_and_answers_keep_credit(problem, gold, answer, credited):
    g = grade(f"So the answer is $\\boxed{{{answer}}}$.", gold, problem=problem)
    assert g.verdict is credited, (answer, g)
    assert g.restated is (not credited), g
    if not credited:
        assert g.as_record()["restated"] is True
        # without the problem text the grader judges value only: the same answer was credited
        assert grade(f"$\\boxed{{{answer}}}$", gold).verdict is True


def test_wrong_answers_stay_wrong_and_settled_forms():
    assert grade("$\\boxed{0.1}$", "\\frac{9}{100}", problem=P742).verdict is False
    assert settled(shape("-\\frac{3}{7}")) and settled(shape("7\\sqrt{2}")) and settled(shape("\\pi"))
    assert not settled(shape("\\frac{6}{14}")) and not settled(shape("\\sqrt{8}"))
    assert chooses("Which is larger, $a$ or $b$?") and not chooses(P742)
    assert not restates(EXPR742, "\\frac{9}{100}", None)


def test_scan_of_math500_refuses_every_restatement():
    items = targets(problems_by_id(None).values())
    assert len(items) >= 80
    before, after = scan(items)
    assert sum(before) >= 15  # the grader judges value: the restated expression was credited
    assert sum(after) == 0


# ------------------------------------------------------------------------------- cut-off outputs

LOOPING = ("We have $x^2 - 4 = 0$, so first $x = 2$ is a candidate. Let me check again. "
           "We have $x^2 - 4 = 0$. Let me check again. We have")


def test_a_cut_off_output_is_graded_on_a_marked_final_only():
    intermediate = "Step 1: the first factor gives $x = 2$.\n\nStep 2: now the other factor gives $x = 7$"
    assert grade(intermediate, "7").verdict is True  # finished: the math fallback reads the last span
    cut = grade(intermediate, "7", finish_reason="length")
    assert cut.verdict is None and cut.reason == "no_answer"
    assert grade(LOOPING, "2", finish_reason="length").reason == "no_answer"
    boxed = grade("so $\\boxed{7}$ and then we keep checking the", "7", finish_reason="length")
    assert boxed.verdict is True and boxed.rule == "boxed"
    stated = grade("Thus the final answer is $7$. Let me double", "7", finish_reason="length")
    assert stated.verdict is True and stated.rule == "final_answer"
    assert grade("Answer: 7\n\nWait, let me", "7", finish_reason="length").verdict is True
    bare = grade_many([("7", "7"), ("7", "7")], finish_reasons=["stop", "length"])
    assert bare[0].verdict is True and bare[1].reason == "no_answer"
    with pytest.raises(ValueError):
        grade_many([("7", "7")], finish_reasons=[])


def _cli(*args, cwd):
    """`retention grade` in this process (a subprocess would import torch again for each call)."""
    from retention.cli import main

    old = os.getcwd()
    os.chdir(cwd)
    try:
        res = CliRunner().invoke(main, list(args))
    finally:
        os.chdir(old)
    return SimpleNamespace(returncode=res.exit_code, stderr=res.stderr, output=res.output)


def test_retention_grade_reads_problem_and_finish_reason(tmp_path):
    rows = [
        {"text": f"$\\boxed{{{EXPR742}}}$", "gold": "\\frac{9}{100}", "problem": P742},
        {"text": f"$\\boxed{{{EXPR742}}}$", "problem_id": "test/precalculus/742.json"},
        {"text": "$\\boxed{\\frac{9}{100}}$", "problem_id": "test/precalculus/742.json"},
        {"text": "first we get $\\frac{9}{100}$ and then", "gold": "\\frac{9}{100}", "finish_reason": "length"},
        {"text": "We get $\\frac{9}{100}$", "gold": "\\frac{9}{100}", "finish_reason": "stop"},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    res = _cli("grade", str(src), "--out", str(out), "--workers", "1", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["verdict"] for g in got] == [False, False, True, None, True]
    assert got[0]["restated"] is True and got[1]["restated"] is True
    assert got[3]["reason"] == "no_answer"
    src.write_text(json.dumps({"text": "1", "gold": "1", "finish_reason": 3}) + "\n")
    bad = _cli("grade", str(src), cwd=tmp_path)
    assert bad.returncode != 0 and "finish_reason" in bad.stderr and "Traceback" not in bad.stderr
