"""The grader: the labelled case file, the 500 gold answers, extraction rules, equivalence rules,
and `retention grade`.

All grading goes through the process-wide worker pool, so the workers start once for the session.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import protocol
from protocol.data import load_problems
from protocol.grading import Grade, extract_answer, grade, grade_many

ROOT = Path(protocol.__file__).resolve().parent.parent
# the shared folder beside the clone; RETENTION_SHARED names it elsewhere (a git worktree)
SHARED = Path(os.environ.get("RETENTION_SHARED") or ROOT.parent / "shared")
CASES = SHARED / "grading" / "cases.jsonl"
CORPUS_DIR = Path(__file__).resolve().parent / "grading_corpus"
CORPUS = CORPUS_DIR / "corpus.jsonl"
TIMEOUT = 10.0  # generous: these tests are about verdicts; safety has its own tests


# ------------------------------------------------------------------------------ the case file

@pytest.fixture(scope="module")
def case_results():
    if not CASES.exists():
        pytest.skip("shared grading cases not present")
    cases = [json.loads(line) for line in CASES.read_text(encoding="utf-8").splitlines() if line.strip()]
    grades = grade_many([(c["pred"], c["gold"]) for c in cases], timeout=TIMEOUT, workers=2)
    return cases, grades


def test_case_file_agreement_at_least_99_percent(case_results):
    cases, grades = case_results
    wrong = [(i, c, g) for i, (c, g) in enumerate(zip(cases, grades)) if g.verdict is not c["expected"]]
    agreement = 1 - len(wrong) / len(cases)
    print(f"\ncase file agreement: {len(cases) - len(wrong)}/{len(cases)} = {agreement:.2%}")
    for i, c, g in wrong:
        print(f"  #{i} [{c['category']}] expected {c['expected']}, got {g.verdict} ({g.reason}); "
              f"extracted {g.extracted!r} via {g.rule}; gold {c['gold']!r}")
    assert agreement >= 0.99


# -------------------------------------------------------------------------- the public corpus

@pytest.fixture(scope="module")
def corpus():
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def corpus_results(corpus):
    return grade_many([(r["pred"], r["gold"]) for r in corpus], timeout=TIMEOUT, workers=2)


def test_corpus_agreement_and_no_false_positive(corpus, corpus_results):
    wrong = [(r, g) for r, g in zip(corpus, corpus_results) if (g.verdict is True) != r["expected"]]
    false_pos = [(r, g) for r, g in wrong if g.verdict is True]
    print(f"\ncorpus agreement: {len(corpus) - len(wrong)}/{len(corpus)}; false positives {len(false_pos)}")
    for r, g in wrong:
        print(f"  [{r['category']}/{r['style']}] expected {r['expected']}, got {g.verdict} ({g.reason}); "
              f"extracted {g.extracted!r} via {g.rule}; gold {r['gold']!r}")
    assert 1 - len(wrong) / len(corpus) >= 0.995
    assert not false_pos


def test_corpus_size_labels_and_categories(corpus):
    assert len(corpus) >= 1000
    assert all(set(r) == {"pred", "gold", "expected", "category", "style", "variant"} for r in corpus)
    by_cat: dict[str, set] = {}
    for r in corpus:
        by_cat.setdefault(r["category"], set()).add(r["expected"])
    math_types = {"integer", "fraction", "radical_pi", "interval", "tuple", "set", "list", "matrix",
                  "equation", "text", "units", "degrees", "base", "complex", "decimal", "expression"}
    families = {"clock", "percent", "mixed_number", "thousands_sep", "multi_part", "chat_leftover",
                "markdown_final", "last_sentence", "several_boxes", "think"}
    assert math_types | families <= set(by_cat), sorted(math_types | families - set(by_cat))
    one_sided = sorted(c for c in math_types | families if by_cat[c] != {True, False})
    assert not one_sided  # every answer type and family has true pairs and near misses
    styles = {r["style"] for r in corpus}
    assert {"r1_think", "truncated_think", "chat_leftover", "hedged_boxes", "markdown_heading",
            "bold_final_answer", "last_sentence", "display_math", "handwritten"} <= styles


def test_corpus_is_what_its_generator_writes(corpus):
    """The data file is the generator's output (no hand edits outside handwritten.jsonl)."""
    import importlib.util

    data = SHARED / "data" / "math500.jsonl"
    if not data.exists():
        pytest.skip("MATH-500 data not present")
    spec = importlib.util.spec_from_file_location("make_corpus", CORPUS_DIR / "make_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.build(data) == corpus


def test_case_file_never_crashes_and_records_a_rule(case_results):
    _, grades = case_results
    assert all(isinstance(g, Grade) for g in grades)
    assert all(g.rule in (None, "boxed", "final_answer", "answer", "math", "is", "bare") for g in grades)
    assert all((g.verdict is None) == (g.reason is not None) for g in grades)


# ------------------------------------------------------------------------- the 500 gold answers

def _last_box(text: str) -> str:
    """Content of the last complete \\boxed{...}, by plain brace counting (independent of the
    extractor under test)."""
    start = text.rfind("\\boxed{")
    assert start >= 0
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    raise AssertionError("unclosed box")


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_every_gold_equals_itself(problems):
    grades = grade_many([(p.answer, p.answer) for p in problems], timeout=TIMEOUT, workers=2)
    bad = [(p.unique_id, g) for p, g in zip(problems, grades) if g.verdict is not True]
    assert not bad, bad
    assert all(g.rule == "bare" or p.answer.startswith("$") for p, g in zip(problems, grades))


def test_every_gold_equals_the_last_box_of_its_solution(problems):
    boxes = [_last_box(p.solution) for p in problems]
    assert boxes == [p.answer for p in problems]  # the data's documented property
    from_box = grade_many([(f"\\boxed{{{b}}}", p.answer) for b, p in zip(boxes, problems)],
                          timeout=TIMEOUT, workers=2)
    assert [g.extracted for g in from_box] == boxes
    assert all(g.verdict is True for g in from_box), [
        (p.unique_id, g) for p, g in zip(problems, from_box) if g.verdict is not True]
    from_solution = grade_many([(p.solution, p.answer) for p in problems], timeout=TIMEOUT, workers=2)
    bad = [(p.unique_id, g) for p, g in zip(problems, from_solution) if g.verdict is not True]
    assert not bad, bad
    assert all(g.rule == "boxed" for g in from_solution)


# --------------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("text, answer, rule", [
    (r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", "boxed"),
    (r"\boxed{\{1, \{2\}\}}", r"\{1, \{2\}\}", "boxed"),                 # escaped braces inside
    (r"\boxed{a^{b^{c}}} and later \boxed{x_{1}}", r"x_{1}", "boxed"),   # last box wins
    (r"the result is \boxed 5.", "5", "boxed"),
    (r"\fbox{7}", "7", "boxed"),
    (r"\boxed{898} \boxed{900}", "898, 900", "boxed"),                    # never fused into 898900
    (r"\boxed{1} and \boxed{2}", "1, 2", "boxed"),
    (r"\boxed{\boxed{3}}", r"\boxed{3}", "boxed"),
    (r"\boxed{3}. Wait, that is wrong. Recomputing, \boxed{4}", "4", "boxed"),
    (r"\boxed{004} ... so \boxed{004}", "004", "boxed"),
    (r"we get \boxed{12} then \boxed{1", "12", "boxed"),                 # truncated last box
    (r"\boxed{200} ... Final Answer: The final answer is $10,455$. I hope it is correct.",
     "10,455", "final_answer"),
    (r"Thus the final answer is $\frac{3}{4}$.", r"\frac{3}{4}", "final_answer"),
    ("so the answer is 0", "0", "final_answer"),
    ("Final Answer: The largest $n$ is 34.", "34", "answer"),
    (r"Answer: $x = 3$", "x = 3", "answer"),
    (r"Answer \( (9+1) \)", "(9+1)", "answer"),
    (r"We find $x=2$ and hence $y = 7$.", "y = 7", "math"),
    (r"price \$5 and $a$", "a", "math"),
    (r"so we have $21,16$ or $11$", "21,16, 11", "math"),
    ("the probability that Alice wins is 2/3. <|im_start|>user", "2/3", "is"),
    (r"\frac{13}{6}", r"\frac{13}{6}", "bare"),
    ("(8,-2)", "(8,-2)", "bare"),
    (r"<think> long </think> The answer: \boxed{5}", "5", "boxed"),
])
def test_extraction_rules(text, answer, rule):
    assert extract_answer(text) == (answer, rule)


# families of outputs whose final answer is not one clean box (issue 11): each rule on its own
FINAL_ANSWER_RULES = [
    # markdown "Final Answer" headings and bold answers
    ("Work.\n\n**Final Answer**\n\n**42**", "42", "final_answer"),
    ("Work.\n\n**Final Answer:** 42", "42", "answer"),
    ("Work.\n\n### Final Answer\nThe number of such integers is **17**.", "17", "final_answer"),
    ("Therefore, the answer is **7**.", "7", "final_answer"),
    # the answer in the last sentence
    ("We count them. Therefore, there are 12 such numbers.", "12", "is"),
    ("We count them. Therefore, there are 12 such numbers.\n\nI hope this helps!", "12", "is"),
    ("So the recipe needs 2 1/2 cups.", "2 1/2", "is"),
    ("Adding it up, the train arrives at 5:30 p.m.", "5:30 p.m.", "is"),
    ("So the answer is twenty-five percent.", "25\\%", "final_answer"),
    ("Therefore, the answer is three-fourths.", "3/4", "final_answer"),
    ("So, the sum of all such $n$ is 120.", "120", "is"),
    # chat-template leftovers and repeated turns after the answer
    ("So $\\boxed{5}$.<|im_end|>\n<|im_start|>user\nAnd 2+2?<|im_end|>\n<|im_start|>assistant\n$\\boxed{4}$",
     "5", "boxed"),
    ("So $\\boxed{5}$.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n$\\boxed{7}$", "5", "boxed"),
    ("So $\\boxed{5}$.</s><s>[INST] next [/INST] $\\boxed{7}$", "5", "boxed"),
    ("So $\\boxed{5}$.\n\nHuman: and 7?\n\nAssistant: $\\boxed{7}$", "5", "boxed"),
    ("So $\\boxed{5}$.\n\nQuestion: What is 1+1?\nAnswer: $\\boxed{2}$", "5", "boxed"),
    ("Problem: find $x$.\n\nSolution: $x = 3$, so $\\boxed{3}$", "3", "boxed"),
    ("<|im_start|>assistant\nThe answer is $\\boxed{5}$<|im_end|>", "5", "boxed"),
    # think blocks: the answer after </think>; the scratchpad's boxes are tentative
    ("<think>maybe \\boxed{7}? no.</think>\n\nThe answer is $\\boxed{5}$.", "5", "boxed"),
    ("<think>\nok\n</think>\nThe answer is 7.", "7", "final_answer"),
    # labelled parts: one ordered answer; hedged boxes: one list
    ("(a) $\\boxed{3}$\n\n(b) $\\boxed{4}$", "(3, 4)", "boxed"),
    ("**Part (b):** $\\boxed{4}$ and **Part (a):** $\\boxed{3}$", "(3, 4)", "boxed"),
    ("I think $\\boxed{3}$ or maybe $\\boxed{4}$", "3, 4", "boxed"),
    ("$\\boxed{3}$. Alternatively, $\\boxed{4}$.", "3, 4", "boxed"),
    ("$\\boxed{3}$. Wait, I dropped a term. $\\boxed{4}$.", "4", "boxed"),
]


@pytest.mark.parametrize("text, answer, rule", FINAL_ANSWER_RULES)
def test_final_answer_rules(text, answer, rule):
    assert extract_answer(text) == (answer, rule)


@pytest.mark.parametrize("text", [
    "So the number of ways is 4 times the",                # a truncated sentence states nothing
    "Now consider $n = 3$. So for n = 4 we",
    "<think>\nSo far $\\boxed{5}$, but let me verify. Expanding again we",  # cut inside the think
    "<think>\nok \\boxed{7}\n</think>",                                   # nothing after it
    "<think>\nok\n</think>\n\n",
])
def test_no_final_answer_in_truncated_outputs(text):
    assert extract_answer(text) == (None, None)
    assert grade(text, "5").reason == "no_answer"


def test_a_different_value_restated_after_the_box_gets_no_credit():
    texts = ["We get $\\boxed{12}$. Thus there are 13 such numbers.",
             "The answer is $\\boxed{12}$. But wait, actually it should be 13.",
             "We get $\\boxed{12}$. Thus there are 12 such numbers.",
             "We get $\\boxed{12}$. The other root is 3, which we reject."]
    got = grade_many([(t, "12") for t in texts] + [(texts[1], "13")], timeout=TIMEOUT)
    assert [g.verdict for g in got] == [False, False, True, True, False]
    assert got[0].others == ("13",) and got[0].as_record()["other_answers"] == ["13"]
    assert "other_answers" not in got[3].as_record()


@pytest.mark.parametrize("text", ["", None, "   ", "word " * 200,
                                  "Let me think step by step.\n\nFirst we expand the product and"])
def test_no_answer(text):
    assert extract_answer(text) == (None, None)
    g = grade(text, "5")
    assert (g.verdict, g.reason, g.extracted, g.rule) == (None, "no_answer", None, None)


# -------------------------------------------------------------------------------- equivalence

EQUIVALENCE = [
    # fractions, decimals, radicals, pi
    (r"\dfrac{13}{6}", r"\frac{13}{6}", True), (r"\frac12", "0.5", True), (r"\tfrac{3}{4}", ".75", True),
    ("0.333", r"\frac13", True), ("0.3", r"\frac13", False), ("2.99", "3", False),
    ("0.3", r"\frac14", False), (r"\sqrt{2}", "1.414", True), (r"\sqrt2", "1.4", False),
    (r"2\sqrt{2}", r"\sqrt{8}", True), (r"\frac{9}{4}\pi", r"\frac94\pi", True), ("3.14", r"\pi", True),
    # exact values that are close but distinct are never equal
    (r"10^{100}+1", r"10^{100}", False), (r"\sqrt{10^{100}+1}", r"10^{50}", False),
    (r"\frac{1}{2^{98}}", r"\frac{1}{2^{99}}", False), (r"\frac{1}{2006!}", r"\frac{1}{2004!}", False),
    (r"\tan(10^{100})", "4", False), (r"2^{10}", "1024", True), ("5!", "120", True),
    # expressions and identities
    ("x^2-1", "(x-1)(x+1)", True), (r"\sin^2 x+\cos^2 x", "1", True), ("x^3+2x+1", "x^2+2x+1", False),
    (r"\log_2 8", "3", True), (r"e^{i\pi}", "-1", True), ("i", r"\sqrt{-1}", True),
    # thousands separators, units, text, degrees, percent
    (r"10,\!080", "10080", True), ("14{,}916", "14916", True), ("1 000", "1000", True),
    (r"\$18.90", "18.90", True), (r"15\mbox{ cm}^2", "15", True), (r"\text{(B)}", "B", True),
    (r"\text{Evelyn}", "evelyn", True), (r"\text{odd}", r"\text{even}", False),
    (r"30^\circ", r"\frac{\pi}{6}", True), (r"50\%", "0.5", True), (r"50\%", "50", True),
    # intervals, inequalities, sets, tuples, lists
    (r"(-\infty, 3]", r"x \le 3", True), ("x>1", r"(1,\infty)", True), ("x>1", r"[1,\infty)", False),
    (r"[2,5)", r"[2,5]", False), (r"x \in [-2,7]", r"-2 \le x \le 7", True),
    (r"\{1,2\}", r"\{2,1\}", True), ("(1,2)", "(2,1)", False), ("1, 2", "2, 1", True),
    (r"{1,3}", "(3,1)", False), (r"\pm 3", "3, -3", True), (r"3, -3", r"\pm 3", True),
    # equations
    ("x=3", "3", True), ("y=3", "x=3", False), (r"y = -\frac{1}{2}x + \frac{3}{4}", "2x+4y-3=0", True),
    ("1", "2x + z = 1", False), ("(p,q)=(1,2)", "(1,2)", True),
    # matrices and complex numbers
    (r"\begin{pmatrix}1\\2\end{pmatrix}", "(1,2)", True),
    (r"\begin{bmatrix}1&2\\3&4\end{bmatrix}", r"\begin{pmatrix}1&2\\3&5\end{pmatrix}", False),
    ("1+274i", "i", False), (r"\frac34i", r"\frac{3}{4}i", True),
    # base subscripts, primes, one-letter units
    ("204_5", "204", True), ("f'", "f", False), ("2f'+1", "1+2f'", True),
    ("2m", "2", False), ("10 m", "10", True), ("1,000.99m^2", "1000.99", True),
    # mixed numbers, percentages, \textnormal units, thousands separators
    ("2 1/2", r"\frac52", True), (r"2\ \frac12", "2.5", True), ("3 1/2", r"\frac52", False),
    (r"2 \frac{1}{2}", "1", False), ("twenty-five percent", r"25\%", True), ("25%", "0.25", True),
    ("25%", "0.025", False), (r"12\textnormal{ cm}", "12", True), (r"12\textnormal{ cm}", "13", False),
    ("1 000 000", "1000000", True), (r"1{,}000{,}000", "10^6", True), (r"10\ 080", "10080", True),
    (r"1{,}001", "1000", False),
    # clock times: never equal to another time, nor to a number
    ("5:30", "5:30", True), ("5:30 PM", r"5:30\text{ p.m.}", True), ("5:30 pm", "17:30", True),
    ("5:30", "5:45", False), ("5:30", "6:30", False), ("5:30", "5.30", False), ("5:30", "17:30", False),
    ("5:30 AM", "17:30", False), (r"9:40\text{ p.m.}", r"9:40\text{ a.m.}", False),
    ("5:30:15", "5:30", False), ("12:00", r"12:00\text{ noon}", True), ("12:30 a.m.", "0:30", True),
    ("7:32", "S_{MBCN}:S=7:32", True),
    # named parts are ordered
    ("(a) 3, (b) 4", "3, 4", True), ("(a) 4, (b) 3", "3, 4", False),
    (r"\text{(a) } 3, \text{ (b) } 4", "(3,4)", True),
]


@pytest.fixture(scope="module")
def equivalence_results():
    return grade_many([(p, g) for p, g, _ in EQUIVALENCE], timeout=TIMEOUT, workers=2)


@pytest.mark.parametrize("k", range(len(EQUIVALENCE)),
                         ids=[f"{p}|{g}" for p, g, _ in EQUIVALENCE])
def test_equivalence(equivalence_results, k):
    pred, gold, expected = EQUIVALENCE[k]
    g = equivalence_results[k]
    assert g.verdict is expected, (pred, gold, g)


def test_adjacent_boxes_are_two_answers_not_one_number():
    both = grade_many([(r"\boxed{898} \boxed{900}", "898900"), (r"\boxed{898} \boxed{900}", "900"),
                       (r"\boxed{898} \boxed{900}", "898, 900")], timeout=TIMEOUT)
    assert [g.verdict for g in both] == [False, False, True]


def test_gold_with_a_box_is_reduced_to_the_box():
    assert grade("42", r"so the answer is $\boxed{42}$").verdict is True


def test_argument_validation():
    with pytest.raises(ValueError):
        grade("1", "1", timeout=0)
    with pytest.raises(ValueError):
        grade("1", "1", timeout=float("nan"))
    with pytest.raises(ValueError):
        grade_many([("1", "1")], workers=0)
    with pytest.raises(TypeError):
        grade("1", None)
    assert grade_many([]) == []


# ------------------------------------------------------------------------------------- the CLI

def _cli():
    from retention.cli import main

    return main


def _write(path: Path, records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
                    encoding="utf-8")


RECORDS = [
    {"problem_id": "test/precalculus/807.json", "text": r"so $\boxed{(3, \frac{\pi}{2})}$", "gold": None},
    {"pred": r"\boxed{7}", "gold": "8"},
    {"text": "I ran out of tokens while", "gold": "3"},
    {"pred": r"\boxed{0.5}", "gold": r"\frac{1}{2}", "sample": 3},
]


def test_cli_grade_to_out_file(tmp_path):
    src, out = tmp_path / "records.jsonl", tmp_path / "graded.jsonl"
    _write(src, RECORDS)
    before = src.read_bytes()
    res = CliRunner().invoke(_cli(), ["grade", str(src), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("graded 4: 2 correct, 1 wrong, 1 ungradable "
                                 "(no_answer 1, timeout 0, unparsable 0)")
    assert src.read_bytes() == before
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["verdict"] for r in got] == [True, False, None, True]
    assert [r["reason"] for r in got] == [None, None, "no_answer", None]
    assert [r["rule"] for r in got] == ["boxed", "boxed", None, "boxed"]
    assert got[0]["extracted"] == r"(3, \frac{\pi}{2})" and got[3]["sample"] == 3


def test_cli_grade_to_stdout_leaves_input_alone(tmp_path):
    src = tmp_path / "records.jsonl"
    _write(src, RECORDS[1:2])
    before = src.read_bytes()
    res = CliRunner().invoke(_cli(), ["grade", str(src)])
    assert res.exit_code == 0
    assert json.loads(res.stdout.splitlines()[0])["verdict"] is False
    assert res.stderr.strip() == ("graded 1: 0 correct, 1 wrong, 0 ungradable "
                                  "(no_answer 0, timeout 0, unparsable 0)")
    assert src.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["records.jsonl"]


def test_cli_grade_in_place_when_out_names_the_input(tmp_path):
    src = tmp_path / "records.jsonl"
    _write(src, RECORDS[3:])
    res = CliRunner().invoke(_cli(), ["grade", str(src), "--out", str(src)])
    assert res.exit_code == 0
    assert json.loads(src.read_text())["verdict"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["records.jsonl"]  # no temp file left


@pytest.mark.parametrize("lines, needle", [
    (['{"pred": "1", "gold": "1"}', '{"pred": "1", "gold'], ":2: not valid JSON"),
    (['{"gold": "1"}'], ":1: record has neither 'pred' nor 'text'"),
    (['{"pred": "1"}'], ":1: record has neither 'gold' nor 'problem_id'"),
    (['{"pred": "1", "problem_id": "test/none/0.json"}'], "unknown problem_id 'test/none/0.json'"),
    (['{"pred": 3, "gold": "3"}'], "must be a string or null"),
    (['[1, 2]'], "expected a JSON object"),
    ([""], "no records"),
])
def test_cli_grade_bad_input_is_one_line_and_writes_nothing(tmp_path, lines, needle):
    src, out = tmp_path / "records.jsonl", tmp_path / "out.jsonl"
    _write(src, lines)
    before = src.read_bytes()
    res = CliRunner().invoke(_cli(), ["grade", str(src), "--out", str(out)])
    assert res.exit_code == 1
    msg = res.output.strip().splitlines()
    assert len(msg) == 1 and msg[0].startswith("Error: ") and needle in msg[0], res.output
    assert src.read_bytes() == before and not out.exists()


def test_cli_grade_missing_file(tmp_path):
    res = CliRunner().invoke(_cli(), ["grade", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 1 and "does not exist" in res.output  # click's usage error, one line, exit 1



# ---------------------------------------------------------------------- --compare math-verify

def _has_math_verify() -> bool:
    from protocol.grading import mathverify

    return mathverify.version() is not None


@pytest.mark.skipif(not _has_math_verify(), reason="math-verify not installed (extra 'mathverify')")
def test_cli_grade_compare_math_verify_writes_both_verdicts_and_the_disagreements(tmp_path):
    src, out, dis = tmp_path / "r.jsonl", tmp_path / "out.jsonl", tmp_path / "dis.jsonl"
    leftover = (r"So $\boxed{5}$.<|im_end|>" "\n<|im_start|>user\nAnd 2+2?<|im_end|>\n"
                r"<|im_start|>assistant\n$\boxed{4}$")
    _write(src, [{"pred": r"so $\boxed{\frac12}$", "gold": "0.5"},  # both credit it
                 {"pred": leftover, "gold": "5"},                    # the next turn's box is not this answer
                 {"pred": r"$\boxed{7}$", "gold": "8"}])             # both refuse it
    res = CliRunner().invoke(_cli(), ["grade", str(src), "--out", str(out), "--compare", "math-verify",
                                      "--disagreements", str(dis)])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["verdict"] for r in got] == [True, True, False]
    assert all(set(r["math_verify"]) == {"verdict", "reason"} for r in got)
    assert got[0]["math_verify"]["verdict"] is True and got[2]["math_verify"]["verdict"] is False
    differ = [json.loads(line) for line in dis.read_text().splitlines()]
    expected = [r for r in got if (r["verdict"] is True) != (r["math_verify"]["verdict"] is True)]
    assert [d["line"] for d in differ] == [got.index(r) + 1 for r in expected]
    assert all({"pred", "gold", "extracted", "verdict", "reason", "math_verify"} <= set(d) for d in differ)
    n = len(differ)
    assert f"math-verify agrees on {3 - n}/3; disagreements {n} " in res.output


def test_cli_grade_disagreements_needs_compare(tmp_path):
    src = tmp_path / "r.jsonl"
    _write(src, RECORDS[1:2])
    res = CliRunner().invoke(_cli(), ["grade", str(src), "--disagreements", str(tmp_path / "d.jsonl")])
    assert res.exit_code == 1 and res.output.strip() == "Error: --disagreements needs --compare"


def test_cli_grade_compare_without_math_verify_is_one_error_line(tmp_path, monkeypatch):
    from protocol.grading import mathverify

    monkeypatch.setattr(mathverify, "version", lambda: None)
    src = tmp_path / "r.jsonl"
    _write(src, RECORDS[1:2])
    res = CliRunner().invoke(_cli(), ["grade", str(src), "--compare", "math-verify"])
    assert res.exit_code == 1
    assert res.output.strip().splitlines() == [
        "Error: math-verify is not installed: pip install 'retention[mathverify]'"]
