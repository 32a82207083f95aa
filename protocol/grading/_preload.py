"""Imported once by the grading forkserver: load sympy and the LaTeX grammar, and run a few
judgements so the parser's caches are warm in every worker forked from it."""

from protocol.grading.equivalence import Unparsable, judge

_WARM = [
    (r"\frac{1}{2}", "0.5"), (r"(1, \sqrt{2})", r"\left(1,\sqrt2\right)"), (r"x \le 3", r"(-\infty, 3]"),
    (r"k = 2\pi", r"2\pi"), (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", "(1,2)"), (r"x^2+1", r"1+x^2"),
]

for _p, _g in _WARM:
    try:
        judge(_p, _g)
    except (Unparsable, Exception):  # warm-up only; a failure here must not stop the server
        pass
