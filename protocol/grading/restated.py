"""An answer must answer: a final that restates an expression of the problem earns no credit.

``Evaluate \\[\\sin (\\arcsin 0.4 + \\arcsin 0.5) \\cdot \\sin (\\arcsin 0.5 - \\arcsin 0.4).\\]``
answered with that same expression is equal in value to the reference ``\\frac{9}{100}``, so the
equivalence judge credits it; but it evaluates nothing. `restates(answer, gold, problem)` says when
an answer is such a copy. Pure string work (no sympy), run in the grading parent before an answer
is shipped to a worker.

An answer restates the problem when all of these hold:

* its *shape* (`shape`: the canonical LaTeX without spaces, brackets, ``\\left``/``\\right``,
  with one spelling for products and binomials, ``^{2}`` as ``^2``, without a leading ``x =``
  or a trailing ``= ?``; compared without product signs) is the shape of a math span of the
  problem, or of one side of an equation in it; of an answer that is an equation, its last side
  is read, and any side that is a value or the reference's form makes it an answer
  (``\\sqrt{242} = 11\\sqrt{2}``);
* it is not in the reference's own form (its shape differs from the reference's shape): where the
  problem's expression already *is* the answer (the reference itself is written in the problem),
  giving it is answering;
* it is not already a value (`settled`): a sum of simplified terms of distinct kinds (a number,
  ``k\\sqrt{m}`` with m square-free, ``k\\pi``, ``kx``), or such a sum over an integer that
  shares no factor with its coefficients; such a form has nothing left to evaluate, so a problem
  that mentions it as a given does not make it a copy;
* the problem does not ask to choose among expressions it lists (`chooses`: lettered options,
  "which of the following", "which is larger"): choosing one is an answer.

Only answers the judge finds equal in value are affected (a wrong answer is wrong anyway), so a
false match can only cost credit to an answer that copies an expression of the problem in a form
other than the reference's. docs/grading.md states the rule and its limits.
"""

from __future__ import annotations

import math
import re

from protocol.grading.canonical import canonical
from protocol.grading.normalize import split_top
from protocol.grading.spans import math_spans

__all__ = ["restates", "shape", "task_shapes", "settled", "chooses"]

_BRACKETS = re.compile(r"[()\[\]]|\\[{}]")
_BINOM = re.compile(r"\\[dt]binom(?![a-zA-Z])")
_PRODUCT = re.compile(r"\\(?:times|cdot|ast)(?![a-zA-Z])|\*")
_SINGLE_SCRIPT = re.compile(r"([_^])\{([^{}\\])\}")
_LEAD_NAME = re.compile(r"^(?:[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?|\\[a-zA-Z]+|[a-zA-Z]\([a-z]\))=(?!=)")
_ASKED = re.compile(r"=\?*$|=\\?\?$")
_TRAILING = re.compile(r"[.,;:?!]+$")

#: One term of a value: a number, times a square root, pi or a letter (`3`, `0.5`, `2\\sqrt{3}`, `\\pi`, `4x`).
_TERM = re.compile(r"(\d+(?:\.\d+)?)?(\\sqrt\{(\d{1,11})\}|\\pi|\\infty|[a-zA-Z])?")
_FRACTION = re.compile(r"\\frac\{([^{}]*(?:\{\d+\}[^{}]*)*)\}\{(\d+)\}")

_CHOICE = re.compile(r"(?i)\bwhich\s+(?:of|one|is|number|expression|value|option)\b|\benter\s+the\s+letter|"
                     r"\bwhich\s+(?:is\s+)?(?:the\s+)?(?:larger|largest|smaller|smallest|greater|greatest|"
                     r"least|bigger|biggest)\b")
_OPTION_LABEL = re.compile(r"\(\s*[A-E]\s*\)|\\text(?:bf)?\{\s*\(?[A-E]\)")

#: Problems longer than this are not scanned (a MATH problem is a few hundred characters).
PROBLEM_MAX_CHARS = 20_000


def shape(s: str) -> str:
    """The spelling-free form of an expression: canonical LaTeX, no spaces, no brackets, one
    product sign, ``^{2}`` as ``^2``, no leading ``x =`` and no trailing ``= ?``."""
    s = canonical(s)
    s = re.sub(r"\s+", "", s)
    s = _TRAILING.sub("", s)
    s = _ASKED.sub("", s)
    s = _PRODUCT.sub("\\\\cdot", s)
    s = _BINOM.sub("\\\\binom", s)
    s = _SINGLE_SCRIPT.sub(r"\1\2", s)
    s = _LEAD_NAME.sub("", s)
    return _BRACKETS.sub("", s)


def _squarefree(n: int) -> bool:
    return n > 0 and all(n % (k * k) for k in range(2, math.isqrt(n) + 1))


def _terms(s: str) -> list[str]:
    """`s` split at its top-level signs (`2+\\sqrt{3}` -> ["2", "\\sqrt{3}"]); a leading sign dropped."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += (c == "{") - (c == "}")
        if c in "+-" and depth == 0 and i > start:
            out.append(s[start:i])
            start = i + 1
        elif c in "+-" and depth == 0:
            start = i + 1
    out.append(s[start:])
    return out


def _kinds(s: str) -> list[tuple[str, int]] | None:
    """(kind, integer coefficient) per term when every term is a simplified monomial, else None."""
    out = []
    for term in _terms(s):
        m = _TERM.fullmatch(term)
        if not term or m is None or (m.group(3) and not _squarefree(int(m.group(3)))):
            return None
        coef = m.group(1) or "1"
        out.append((m.group(2) or "1", int(coef) if coef.isdigit() else 1))
    return out


def settled(s: str) -> bool:
    """True when the shape `s` is already a value: nothing in it is left to evaluate. A value is a
    sum of terms of distinct kinds (a number, `k\\sqrt{m}` with m square-free, `k\\pi`, `kx`:
    `2+\\sqrt{3}`, `x+1`, `-5`, `0.09`), or such a sum over an integer sharing no factor with its
    integer coefficients (`\\frac{9}{100}`, `\\frac{\\sqrt{2}}{2}`, `\\frac{\\pi}{7}`)."""
    m = _FRACTION.fullmatch(s.lstrip("-"))
    top, den = (m.group(1), int(m.group(2))) if m else (s, 1)
    kinds = _kinds(top)
    if not kinds or den == 0 or len({k for k, _ in kinds}) < len(kinds):
        return False
    return math.gcd(den, *(c for _, c in kinds)) == 1 or den == 1


def chooses(problem: str) -> bool:
    """True when the problem asks to choose among expressions it lists."""
    return bool(_CHOICE.search(problem)) or len(set(_OPTION_LABEL.findall(problem))) >= 2


def _unsigned(key: str) -> str:
    """A shape without its product signs: `\\sin a \\sin b` copies `\\sin a \\cdot \\sin b` too."""
    return key.replace("\\cdot", "")


def task_shapes(problem: str) -> set[str]:
    """The shapes of the problem's math spans and of each side of an equation in one, without
    their product signs (`_unsigned`)."""
    out = set()
    for _, _, content in math_spans(problem[:PROBLEM_MAX_CHARS]):
        for part in (content, *split_top(content, ("=",))):
            key = _unsigned(shape(part))
            if key:
                out.add(key)
    return out


_NAME = re.compile(r"[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?|[a-zA-Z]\([a-z]\)")


def _sides(text: str) -> list[str]:
    """The sides of an equation (one side for an expression), a leading name (`x =`) dropped."""
    sides = [p for p in split_top(text, ("=",)) if p.strip()] or [text]
    if len(sides) > 1 and _NAME.fullmatch(shape(sides[0])):
        sides = sides[1:]
    return sides


def restates(answer: str, gold: str, problem: str | None) -> bool:
    """True when `answer` copies an expression of `problem` instead of answering it (module doc).
    An equation answers when any of its sides is a value or the reference's form
    (`\\sqrt{242} = 11\\sqrt{2}`, `\\frac{9}{100} = \\sin a \\sin b`); else its last side is read."""
    if not problem or not isinstance(problem, str) or chooses(problem):
        return False
    keys = [shape(side) for side in _sides(answer)]
    ref = shape(_sides(gold)[-1])
    if any(not key or settled(key) or key == ref for key in keys):
        return False
    # matched without product signs; whether it is a value was read with them (`2 \\cdot 3` is no `23`)
    return _unsigned(keys[-1]) in task_shapes(problem)
