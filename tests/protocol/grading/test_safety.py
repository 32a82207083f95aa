"""Safety of the grader on hostile model output: bounded time, bounded memory, no evaluation,
no exception escaping, and no false equality for values that cannot be computed.

The per-call time bound is asserted here (unlike benchmarks elsewhere) because it *is* the
property under test: every call returns within its timeout plus a small margin.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol
from protocol.grading import REASONS, RULES, extract_answer, grade, grade_many
from protocol.grading.worker import WorkerPool

TIMEOUT = 2.0
MARGIN = 1.5  # process kill + replacement fork + IPC on a loaded 2-core machine

ADVERSARIAL = [
    r"\boxed{9^{9^{9^{9}}}}",
    r"\boxed{100000!}",
    r"\boxed{10^{10}!}",
    r"\boxed{4^{10^{10}}}",
    r"\boxed{(x+1)^{100000}}",
    r"\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    r"\boxed{10^{-10^{10}}}",
    r"\boxed{(1+\sqrt{2})^{10^{6}}}",
    r"\boxed{\sqrt{2}^{10^{7}}}",
    r"\boxed{x^{10^{10}} - x^{10^{10}} + 4}",
    r"\boxed{\prod_{k=1}^{10^9} k}",
    r"\boxed{\sum_{k=1}^{10^{10}} k^2}",
    r"\boxed{\int_0^{10^{10}} e^{x^2} dx}",
    r"\boxed{\lim_{x\to\infty} x^{x^x}}",
    r"\boxed{\Gamma(10^{10})}",
    r"\boxed{\binom{10^{10}}{10^{5}}}",
    r"\boxed{\gcd(10^{10^{10}}, 4)}",
    r"\boxed{\tan(10^{100})}",
    r"\boxed{e^{e^{e^{e^{10}}}}}",
    r"\boxed{\operatorname{zeros}(100000, 100000)}",
    r"\boxed{\det\begin{pmatrix}" + r"\\".join("&".join(f"x_{{{i}{j}}}" for j in range(9))
                                               for i in range(9)) + r"\end{pmatrix}}",
    r"\boxed{" + "+".join(["(x+y+z)^{60}"] * 20) + "}",
    r"\boxed{" + "{" * 3000 + "1" + "}" * 3000 + "}",
    "{" * 5000 + "4" + "}" * 5000,
    r"\boxed{" + "(" * 2000 + "4" + ")" * 2000 + "}",
    "4" * 1_000_000,
    r"\boxed{" + "9" * 1_000_000 + "}",
    "a" * 1_000_000,
    "$" * 100_000,
    r"\boxed" * 100_000,
    r"\frac" * 50_000,
    "\\" * 200_000,
    r"\boxed{" * 50_000 + "4",
    r"$\boxed{4}$ " * 20_000,
    "__import__('os').system('touch /tmp/retention_grader_pwned')",
    r"\boxed{__import__('os').system('touch /tmp/retention_grader_pwned')}",
    r"\boxed{\text{" + "lambda: 0" * 1000 + "}}",
]


REALLY_4 = {i for i, a in enumerate(ADVERSARIAL)
            if a.startswith(r"$\boxed{4}$") or "x^{10^{10}} - x^{10^{10}} + 4" in a}


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    """Start the shared workers once, so per-call bounds measure grading, not process start-up."""
    grade("1", "1", timeout=30)


def _timed(pred: str, gold: str) -> tuple[float, object]:
    t0 = time.monotonic()
    g = grade(pred, gold, timeout=TIMEOUT)
    return time.monotonic() - t0, g


def _valid(g) -> bool:
    return (g.verdict in (True, False) and g.reason is None) or (
        g.verdict is None and g.reason in REASONS)


@pytest.mark.parametrize("k", range(len(ADVERSARIAL)), ids=[repr(a[:40]) for a in ADVERSARIAL])
def test_adversarial_output_is_bounded_and_never_equal_to_4(k):
    elapsed, g = _timed(ADVERSARIAL[k], "4")
    assert elapsed <= TIMEOUT + MARGIN, (elapsed, g)
    assert _valid(g) and g.rule in RULES + (None,)
    if k in REALLY_4:
        return  # these do mean 4: only boundedness is asserted
    assert g.verdict is not True, g


def test_huge_power_is_not_equal_to_its_base():
    assert grade(r"4^{10^{10}}", "4", timeout=TIMEOUT).verdict is False
    assert grade(r"\boxed{4^{10^{10}}}", "4", timeout=TIMEOUT).verdict is False
    # identical spellings of an uncomputable value are still the same answer
    assert grade(r"\boxed{4^{10^{10}}}", r"4^{10^{10}}", timeout=TIMEOUT).verdict is True
    assert grade(r"\boxed{100000!}", "100000!", timeout=TIMEOUT).verdict is True


def test_adjacent_huge_boxes_do_not_fuse():
    g = grade(r"\boxed{898} \boxed{900}", "898900", timeout=TIMEOUT)
    assert (g.extracted, g.verdict) == ("898, 900", False)


def test_nothing_is_executed():
    marker = Path("/tmp/retention_grader_pwned")
    if marker.exists():
        pytest.skip("marker file left by something else")
    grade_many([(a, "0") for a in ADVERSARIAL[-3:]], timeout=TIMEOUT)
    assert not marker.exists()


def test_batch_of_adversarial_outputs_is_bounded():
    t0 = time.monotonic()
    grades = grade_many([(a, "4") for a in ADVERSARIAL], timeout=TIMEOUT, workers=2)
    elapsed = time.monotonic() - t0
    assert all(_valid(g) for g in grades)
    # worst case: every item times out, two at a time
    assert elapsed <= (len(ADVERSARIAL) / 2 + 1) * (TIMEOUT + MARGIN)


def test_no_eval_sympify_or_parse_expr_in_the_grader():
    src = Path(protocol.__file__).resolve().parent / "grading"
    pattern = re.compile(r"\b(?:eval|exec|sympify|parse_expr|S)\s*\(")
    for path in src.glob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            code = line.split("#", 1)[0]
            assert not pattern.search(code.replace("literal_eval", "")), f"{path.name}:{n}: {line}"


# ------------------------------------------------------------------------------- hypothesis

LATEX_ALPHABET = list("0123456789+-*/^_{}()[]=<>.,;:!| $\\&%'") + [
    r"\frac", r"\sqrt", r"\boxed", r"\pi", r"\infty", r"\cdot", r"\times", r"\le", r"\text{and}",
    r"\left(", r"\right)", r"\pm", r"\cup", r"\begin{pmatrix}", r"\end{pmatrix}", r"\\", "x", "y",
    "i", "e", "!", r"\sum_{k=1}^{n}", r"\int", r"\binom", r"\Gamma", r"\operatorname{ones}",
]

tokens = st.lists(st.sampled_from(LATEX_ALPHABET), max_size=40).map("".join)


@st.composite
def hostile(draw):
    kind = draw(st.sampled_from(["tower", "factorial", "nest", "long", "power", "tokens", "text"]))
    n = draw(st.integers(min_value=1, max_value=12))
    if kind == "tower":
        return "^{".join(["9"] * (n + 2)) + "}" * (n + 1)
    if kind == "factorial":
        return f"10^{{{n}}}!" + "!" * draw(st.integers(0, 3))
    if kind == "nest":
        depth = draw(st.integers(min_value=10, max_value=4000))
        return draw(st.sampled_from(["{", "(", r"\sqrt{", r"\frac{1}{"])) * depth + "4" + "}" * depth
    if kind == "long":
        return draw(st.sampled_from(["1", "x+", r"\boxed{", "$", "("])) * draw(
            st.integers(min_value=10_000, max_value=1_000_000))
    if kind == "power":
        return f"(x+{n})^{{{10 ** draw(st.integers(3, 12))}}}"
    if kind == "text":
        return draw(st.text(max_size=200))
    return draw(tokens)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(pred=st.one_of(hostile(), tokens, st.text(max_size=300)),
       boxed=st.booleans(), gold=st.sampled_from(["4", r"\frac{1}{2}", "(1,2)", "x+1", r"\text{odd}"]))
def test_property_bounded_and_well_formed(pred, boxed, gold):
    text = f"The answer is $\\boxed{{{pred}}}$." if boxed else pred
    elapsed, g = _timed(text, gold)
    assert elapsed <= TIMEOUT + MARGIN, (elapsed, g)
    assert _valid(g)
    if g.extracted is None:
        assert g.reason == "no_answer" and g.rule is None
    else:
        assert g.rule in RULES


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(max_size=2000))
def test_property_extraction_never_raises(text):
    ans, rule = extract_answer(text)
    assert (ans is None and rule is None) or (isinstance(ans, str) and rule in RULES)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(a=st.integers(-10**30, 10**30), b=st.integers(-10**30, 10**30))
def test_property_integers(a, b):
    same, other = grade_many([(f"\\boxed{{{a}}}", str(a)), (f"\\boxed{{{a}}}", str(b))],
                             timeout=TIMEOUT)
    assert same.verdict is True
    assert other.verdict is (a == b)


# ----------------------------------------------------------------------------------- workers

@pytest.fixture(scope="module")
def own_pool():
    """A private one-worker pool (256 MiB cap) that these tests may kill without touching the
    shared one."""
    pool = WorkerPool(1, memory_mb=256)
    yield pool
    pool.close()


def test_timeout_kills_and_replaces_the_worker(own_pool):
    slow = r"\begin{pmatrix}1&2\\3&4\end{pmatrix}\begin{pmatrix}5&6\\7&8\end{pmatrix}"
    gold = r"\begin{pmatrix}19&22\\43&50\end{pmatrix}"
    assert own_pool.run([(slow, gold)], timeout=30) == [("ok", True, None)]
    old_pid, restarts = own_pool.pids()[0], own_pool.restarts
    # A pair this worker has not graded yet, and a large one: a repeated pair may come back from
    # sympy's caches within the 2 ms deadline, and so did an unseen 2x2 product once (seen under load);
    # a 5x5 product takes about 30 ms to grade here even warm.
    unseen = (r"\begin{pmatrix}5&7&11&13&17\\19&23&29&31&37\\41&43&47&53&59\\61&67&71&73&79\\83&89&97&101&103\end{pmatrix}"
              r"\begin{pmatrix}173&179&181&191&193\\197&199&211&223&227\\229&233&239&241&251\\257&263&269&271&277\\281&283&293&307&311\end{pmatrix}")
    product = (r"\begin{pmatrix}12881&13081&13489&13909&14203\\32823&33359&34403&35507&36261\\56527&57483&59271&61223&62501"
               r"\\80971&82351&84931&87739&89593\\109005&110881&114333&118069&120579\end{pmatrix}")
    t0 = time.monotonic()
    status, verdict, _ = own_pool.run([(unseen, product)], timeout=0.002)[0]
    assert status == "timeout" and verdict is None
    assert time.monotonic() - t0 < 1.0
    assert own_pool.restarts == restarts + 1 and own_pool.pids()[0] != old_pid
    assert own_pool.run([(slow, gold)], timeout=30) == [("ok", True, None)]


def test_a_crashed_worker_is_replaced(own_pool):
    assert own_pool.run([("1", "1")], timeout=30)[0][0] == "ok"
    restarts = own_pool.restarts
    os.kill(own_pool.pids()[0], signal.SIGKILL)  # a worker this test's pool started
    time.sleep(0.2)
    assert own_pool.run([("x+1", "1+x")], timeout=30) == [("ok", True, None)]
    assert own_pool.restarts == restarts + 1


def test_workers_run_under_a_memory_cap(own_pool):
    (soft, _hard), vm = own_pool.limits()[0]
    assert soft > 0 and vm is not None
    assert vm < soft <= vm + 300 * 1024 * 1024


def test_tiny_memory_cap_fails_closed():
    """With almost no headroom, grading fails as 'unparsable' (MemoryError or a dead worker),
    never with an exception in the caller or a wrong verdict."""
    pool = WorkerPool(1, memory_mb=1)
    try:
        tasks = [(r"\begin{pmatrix}" + r"\\".join("&".join(str(i * j) for j in range(10))
                                                   for i in range(10)) + r"\end{pmatrix}", "1")] * 3
        for status, verdict, _ in pool.run(tasks, timeout=30):
            assert (status, verdict) in (("ok", False), ("unparsable", None))
    finally:
        pool.close()


def test_grading_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(grade(r"\boxed{9^{9^{9^{9}}}}", "1",
                                                         timeout=TIMEOUT)))
    t.start()
    t.join(TIMEOUT + 30)
    assert not t.is_alive() and out and out[0].verdict is False


def test_math_verify_runs_under_the_same_kill():
    """`--compare math-verify` runs math-verify in the grading workers: a computation its own
    alarm could not stop is killed at the deadline, and the worker is replaced."""
    from protocol.grading import mathverify, second_opinions

    if mathverify.version() is None:
        pytest.skip("math-verify not installed (extra 'mathverify')")
    second_opinions([("1", "1")], "math-verify", timeout=60)  # import it in the workers first
    t0 = time.monotonic()
    got = second_opinions([(r"\boxed{10^{10}!}", "4"), (r"\boxed{4}", "4")], "math-verify",
                          timeout=TIMEOUT)
    assert time.monotonic() - t0 <= 2 * (TIMEOUT + MARGIN) + 2  # a fresh worker imports it again
    assert got[0].verdict is not True and got[1].verdict is True
