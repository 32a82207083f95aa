"""Grader benchmark: 500 MATH-500 golds, 500 solutions and 500 adversarial outputs (2 workers, 5 s).

Run: `.venv/bin/python scripts/bench_grader.py` (prints timings; asserts nothing)."""
import collections
import random
import time

from protocol.data import load_problems
from protocol.grading import grade, grade_many
from protocol.grading.worker import default_pool

def adversarial(n, seed=0):
    rng = random.Random(seed)
    toks = list("0123456789+-*/^_{}()[]=<>.,;:!| $\\&%'") + [r"\frac", r"\sqrt", r"\boxed", r"\pi", r"\infty",
            r"\cdot", r"\left(", r"\right)", r"\pm", r"\cup", r"\begin{pmatrix}", r"\end{pmatrix}", r"\\", "x", "!",
            r"\sum_{k=1}^{n}", r"\int", r"\binom", r"\Gamma"]
    makers = [
        lambda: "^{".join(["9"] * rng.randint(3, 12)) + "}" * 0,
        lambda: "9" + "".join("^{9" for _ in range(rng.randint(2, 8))) + "}" * 8,
        lambda: f"{10 ** rng.randint(3, 9)}!",
        lambda: f"10^{{{rng.randint(5, 12)}}}!",
        lambda: f"{rng.randint(2, 9)}^{{10^{{{rng.randint(4, 12)}}}}}",
        lambda: f"(x+{rng.randint(1, 9)})^{{{10 ** rng.randint(3, 6)}}}",
        lambda: "{" * rng.randint(100, 5000) + "4" + "}" * rng.randint(100, 5000),
        lambda: r"\frac{1}{" * rng.randint(50, 2000) + "2" + "}" * 2000,
        lambda: rng.choice(["1", "x+", r"\boxed{", "(", "$"]) * rng.randint(10_000, 1_000_000),
        lambda: r"\sum_{k=1}^{10^{%d}} k^{%d}" % (rng.randint(5, 12), rng.randint(2, 9)),
        lambda: r"\int_0^{10^{%d}} e^{x^{%d}} dx" % (rng.randint(2, 9), rng.randint(2, 9)),
        lambda: r"\prod_{k=1}^{10^{9}} k",
        lambda: r"\det\begin{pmatrix}" + r"\\".join("&".join(f"x_{{{i}{j}}}" for j in range(9)) for i in range(9)) + r"\end{pmatrix}",
        lambda: "".join(rng.choice(toks) for _ in range(rng.randint(5, 80))),
        lambda: rf"\boxed{{{rng.randint(100, 999)}}} \boxed{{{rng.randint(100, 999)}}}",
        lambda: "9" * rng.randint(61, 100_000),
        lambda: r"\tan(10^{%d})" % rng.randint(50, 500),
        lambda: r"e^{e^{e^{e^{%d}}}}" % rng.randint(5, 50),
    ]
    out = []
    for i in range(n):
        body = makers[i % len(makers)]()
        out.append(rng.choice([f"The answer is $\\boxed{{{body}}}$.", body, f"Final Answer: The final answer is ${body}$."]))
    return out

def main():
    ps = load_problems()
    t = time.monotonic(); grade("1", "1"); print(f"pool start (zygote import + warm-up + 1 grade): {time.monotonic() - t:.2f} s")
    t = time.monotonic(); g = grade_many([(p.answer, p.answer) for p in ps], timeout=5, workers=2)
    print(f"500 golds vs themselves: {time.monotonic() - t:.2f} s, {sum(x.verdict is True for x in g)}/500 equal")
    t = time.monotonic(); g = grade_many([(p.solution, p.answer) for p in ps], timeout=5, workers=2)
    print(f"500 solutions vs golds:  {time.monotonic() - t:.2f} s, {sum(x.verdict is True for x in g)}/500 equal")
    adv = adversarial(500)
    print(f"adversarial inputs: {len(adv)}, total {sum(map(len, adv)) / 1e6:.1f} MB, longest {max(map(len, adv)) / 1e6:.1f} MB")
    pool = default_pool(); r0 = pool.restarts
    t = time.monotonic(); g = grade_many([(a, p.answer) for a, p in zip(adv, ps)], timeout=5, workers=2)
    dt = time.monotonic() - t
    print(f"500 adversarial vs golds (2 workers, 5 s): {dt:.2f} s; verdicts {collections.Counter((x.verdict, x.reason) for x in g)}; "
          f"workers replaced {pool.restarts - r0}")
    worst = []
    t = time.monotonic()
    for a, p in zip(adv, ps):
        t1 = time.monotonic(); grade(a, p.answer, timeout=5); worst.append(time.monotonic() - t1)
    print(f"same 500 one call at a time: total {time.monotonic() - t:.2f} s, max per call {max(worst):.2f} s, "
          f"calls over 1 s: {sum(w > 1 for w in worst)}, over 5 s: {sum(w > 5 for w in worst)}")

if __name__ == "__main__":
    main()
