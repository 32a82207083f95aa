"""`canonical(s)`: one LaTeX spelling per meaning for a whole answer (pure string work).

``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, no ``\\left``/``\\right``/spacing
commands, thousands separators (``10,\\!080``, ``14{,}916``) removed, currency removed, relation
spellings unified (``>=``, ``\\ge`` -> ``\\geq``), matrix environments (and nested bracketed lists,
and matrices with doubled backslashes) -> ``pmatrix``, other scripts' digits -> ASCII, Unicode math
-> LaTeX. `compact(s)` is the canonical form without spaces.
"""

from __future__ import annotations

import re

from protocol.grading.multilingual import DIGITS
from protocol.grading.notation import list_matrix, undouble

__all__ = ["canonical", "compact", "match_close"]


_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u2014": "-", "\u00d7": "\\times ", "\u22c5": "\\cdot ",
    "\u00b7": "\\cdot ", "\u00f7": "\\div ", "\u03c0": "\\pi ", "\u221e": "\\infty ",
    "\u2264": "\\leq ", "\u2265": "\\geq ", "\u2260": "\\neq ", "\u00b1": "\\pm ", "\u2213": "\\mp ",
    "\u222a": "\\cup ", "\u2229": "\\cap ", "\u2208": "\\in ", "\u00b0": "^\\circ ", "\u00b2": "^2",
    "\u00b3": "^3", "\u221a": "\\sqrt", "\u2026": "\\ldots ", "\u00a0": " ", "\u2009": " ",
    "\u202f": " ", "\u200b": "", "\u20ac": "", "\u00a3": "", "\u00a5": "", "\uff0c": ",",
    "\u2248": "\\approx ",
}
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))

# `\\frac` written with a doubled backslash (JSON/raw-string artefacts): only before command
# names, because `\\` followed by anything else is a matrix row separator.
_DOUBLED = re.compile(r"(?<!\\)\\\\(?=(?:[dtc]?frac|sqrt|pi|text|mbox|boxed|left|right|cdot|times|"
                      r"infty|le|ge|neq|pm|mp|circ|cup|in|begin|end|mathrm|mathbf|ldots|dots)"
                      r"(?![a-zA-Z]))")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|"
                         r"bigg|Bigg)(?![a-zA-Z])\s*(\.|\\[{}|]|\\langle|\\rangle|\\lvert|\\rvert|"
                         r"\\vert|\\lbrack|\\rbrack|[()\[\]|])?")
_STYLE = re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|limits|nolimits)(?![a-zA-Z])")
_WRAPPERS = re.compile(r"\\(?:mathrm|mathbf|boldsymbol|bm|mathit|mathsf|mathnormal|rm|bf)\s*"
                       r"\{([^{}]*)\}")
_FRAC_CMD = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_FRAC_SHORT = re.compile(r"\\frac\s*(\{[^{}]*\}|[0-9a-zA-Z]|\\[a-zA-Z]+)\s*"
                         r"(\{[^{}]*\}|[0-9a-zA-Z]|\\[a-zA-Z]+)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(?!\s*[\[{])([0-9]+|[a-zA-Z]|\\[a-zA-Z]+)")
# a digit group separator that LaTeX spells: `{,}` (also `{, }`), `\,`, `{\,}`, `\!`, `\ `, `~`, or a mix (`{,}\!`,
# `,\,`); a plain comma or space alone is left to the whole-answer rule (it may separate items)
_SEP_CMD = r"(?:\{\s*(?:,|\\[,;:! ])\s*\}|(?<!\\)\\[,;:! ]|~)"
_THOUSANDS_CMD = re.compile(r"(?<=\d)[,\s]*" + _SEP_CMD + r"(?:" + _SEP_CMD + r"|[,\s])*(?=\d{3}(?!\d))")
_SPACES = re.compile(r"(?<!\\)\\[,;:! ]|\\q?quad(?![a-zA-Z])|~")
_REL_SPELL = [
    (re.compile(r">=|\\geqslant(?![a-zA-Z])|\\geq(?![a-zA-Z])|\\ge(?![a-zA-Z])"), r"\\geq "),
    (re.compile(r"<=|\\leqslant(?![a-zA-Z])|\\leq(?![a-zA-Z])|\\le(?![a-zA-Z])"), r"\\leq "),
    (re.compile(r"!=|\\neq(?![a-zA-Z])|\\ne(?![a-zA-Z])"), r"\\neq "),
    (re.compile(r"\\lt(?![a-zA-Z])"), "<"),
    (re.compile(r"\\gt(?![a-zA-Z])"), ">"),
]
_MATRIX_ENV = re.compile(r"\\begin\{(?:bmatrix|Bmatrix|matrix|smallmatrix|array)\}(?:\{[lcr|\s]*\})?")
_MATRIX_END = re.compile(r"\\end\{(?:bmatrix|Bmatrix|matrix|smallmatrix|array)\}")
_ROW_END = re.compile(r"\\\\\s*(?=\\end\{pmatrix\})")
_DOTS = re.compile(r"\\(?:ldots|cdots|dots|dotsc|dotsb|dotso)(?![a-zA-Z])|\.\.\.")


def _strip_outer(s: str) -> str:
    """Remove wrappers around the whole answer: `$..$`, `\\(..\\)`, `\\[..\\]`, `\\boxed{..}`."""
    prev = None
    while prev != s:
        prev = s
        s = s.strip()
        for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
            if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
                s = s[len(a):len(s) - len(b)]
        m = re.match(r"\\(?:boxed|fbox)\s*\{", s)
        if m and match_close(s, m.end() - 1) == len(s) - 1:
            s = s[m.end():-1]
    return s


def match_close(s: str, i: int) -> int:
    """Index of the bracket closing the opener at `i` (any of `([{`; mixed pairs such as `[a, b)`
    are intervals, so all kinds count as one depth), or -1."""
    depth = 0
    j = i
    n = len(s)
    while j < n:
        c = s[j]
        if c == "\\" and j + 1 < n:
            j += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j
        j += 1
    return -1


def canonical(s: str) -> str:
    """The canonical LaTeX of a whole answer (see the module docstring)."""
    s = _UNICODE_RE.sub(lambda m: _UNICODE[m.group(0)], s.translate(DIGITS))
    s = _DOUBLED.sub(r"\\", undouble(s))
    s = _strip_outer(s)
    s = _STYLE.sub(" ", s)
    s = _LEFT_RIGHT.sub(lambda m: "" if m.group(1) in (None, ".") else m.group(1), s)
    s = _WRAPPERS.sub(r"\1", s)
    s = _FRAC_CMD.sub(r"\\frac", s)
    for _ in range(3):  # nested short forms such as \frac1{\frac12}
        s2 = _FRAC_SHORT.sub(lambda m: "\\frac" + _brace(m.group(1)) + _brace(m.group(2)), s)
        if s2 == s:
            break
        s = s2
    s = _SQRT_SHORT.sub(lambda m: "\\sqrt{" + m.group(1) + "}", s)
    s = _THOUSANDS_CMD.sub("", s)
    s = _SPACES.sub(" ", s)
    for pat, rep in _REL_SPELL:
        s = pat.sub(rep, s)
    s = re.sub(r"\+\s*\\infty", r"\\infty", s)
    s = re.sub(r"\\mathbb\s*\{?R\}?", r"(-\\infty, \\infty)", s)  # the real line as an interval
    s = _MATRIX_ENV.sub(r"\\begin{pmatrix}", s)
    s = _MATRIX_END.sub(r"\\end{pmatrix}", s)
    s = _ROW_END.sub("", s)
    s = _DOTS.sub(r"\\ldots ", s)
    s = s.replace("\\$", " ").replace("$", " ")
    s = re.sub(r"\s+", " ", s).strip()
    # a lone matrix in brackets: [\begin{pmatrix}..\end{pmatrix}]
    m = re.fullmatch(r"[\[(]\s*(\\begin\{pmatrix\}.*\\end\{pmatrix\})\s*[\])]", s)
    if m and m.group(1).count("\\begin{pmatrix}") == 1:
        s = m.group(1)
    s = re.sub(r"(?:\\(?![a-zA-Z{}\\])|[.;,])+$", "", s).strip()  # `185\`, trailing period
    return list_matrix(s)


def _brace(arg: str) -> str:
    return arg if arg.startswith("{") else "{" + arg + "}"


def compact(s: str) -> str:
    """Canonical form without spaces: the key of "exact string equality after normalisation"."""
    return re.sub(r"\s+", "", s)
