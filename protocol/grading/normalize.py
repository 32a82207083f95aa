"""String normalisation of MATH answers and their structure (lists, tuples, intervals, relations).

Two stages, both pure string work (no sympy here):

* `canonical(s)`: one LaTeX spelling per meaning for the whole answer: ``\\dfrac``/``\\tfrac`` ->
  ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, no ``\\left``/``\\right``/spacing commands, thousands
  separators (``10,\\!080``, ``14{,}916``, ``1,000.99``, ``1 000``) removed, currency removed,
  relation spellings unified (``>=``, ``\\ge`` -> ``\\geq``), matrix environments -> ``pmatrix``.
* `parse(s)`: a small tree of `Node` objects. Leaves keep LaTeX text (sympy conversion happens in
  `equivalence`, inside the worker); leaf-level normalisation strips units, ``\\text{}`` words,
  degrees and percent (recorded as flags), base subscripts (``204_5`` -> ``204``).

The tree is what makes "ordered tuple vs unordered list", "interval vs inequality" and
"``x = 3`` vs ``3``" decidable; `equivalence` compares trees.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from protocol.grading.multilingual import DIGITS
from protocol.grading.notation import list_matrix, undouble

__all__ = ["canonical", "compact", "parse", "MAX_ANSWER_CHARS", "Node", "Leaf", "Text", "Seq", "Interval", "Union",
           "Chain", "Member", "Rel", "Dots", "Clock", "NormalizeError"]


#: Longest answer (after extraction) that is parsed at all; longer ones are only compared as text.
MAX_ANSWER_CHARS = 5000


class NormalizeError(ValueError):
    """The answer has no readable structure (empty, unbalanced brackets, ...)."""


# ----------------------------------------------------------------------------------------- nodes

@dataclass(frozen=True)
class Node:
    pass


@dataclass(frozen=True)
class Leaf(Node):
    """A scalar (or matrix) in LaTeX; `percent`/`degrees` say a unit marker was removed."""
    text: str
    percent: bool = False
    degrees: bool = False


@dataclass(frozen=True)
class Text(Node):
    """A text answer, normalised: lower case, no ``\\text{}``, no parentheses around a letter."""
    text: str


@dataclass(frozen=True)
class Seq(Node):
    """`tuple`: ``(a, b)``, ordered; `list`: ``a, b`` / ``a and b``; `set`: ``\\{a, b\\}``;
    `pm`: the two values of ``a \\pm b`` (a list)."""
    kind: str
    items: tuple[Node, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Interval(Node):
    left: str  # "(" or "["
    a: Node
    b: Node
    right: str  # ")" or "]"


@dataclass(frozen=True)
class Union(Node):
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Chain(Node):
    """``a = b = c``; a label on the left (``x = 3``) makes the last part the value."""
    parts: tuple[Node, ...]
    label_hint: bool = False  # the left part looks like a name (x, f(x), A:B) at string level


@dataclass(frozen=True)
class Member(Node):
    """``x \\in S``."""
    elem: Node
    container: Node


@dataclass(frozen=True)
class Rel(Node):
    """An inequality or ``\\neq`` (possibly chained), kept as LaTeX for sympy."""
    text: str


@dataclass(frozen=True)
class Clock(Node):
    """A time of day ``5:30``, ``5:30 p.m.``: `seconds` after midnight (read on a 12-hour dial
    when `meridiem` is None)."""
    seconds: int
    meridiem: str | None  # "am", "pm", "24h" (an hour 0 or 13-24), or None (1-12, either half)


@dataclass(frozen=True)
class Dots(Node):
    """``\\ldots`` inside a list: only equal to itself, and makes the list ordered."""


# ------------------------------------------------------------------------------ canonical form

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
# a digit group separator that LaTeX spells: `{,}`, `\,`, `{\,}`, `\!`, `\ `, `~`, or a mix (`{,}\!`,
# `,\,`); a plain comma or space alone is left to the whole-answer rule (it may separate items)
_SEP_CMD = r"(?:\{(?:,|\\[,;:! ])\}|(?<!\\)\\[,;:! ]|~)"
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
        if m and _match_close(s, m.end() - 1) == len(s) - 1:
            s = s[m.end():-1]
    return s


def _match_close(s: str, i: int) -> int:
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


# ------------------------------------------------------------------------------------ splitting

def split_top(s: str, seps: tuple[str, ...]) -> list[str]:
    """Split `s` on any of `seps` at bracket depth 0 (`\\begin..\\end` counts as a bracket)."""
    parts, depth, start, i, n = [], 0, 0, 0, len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            if s.startswith("\\begin", i):
                depth += 1
            elif s.startswith("\\end", i):
                depth -= 1
            elif depth == 0:
                hit = next((p for p in seps if p.startswith("\\") and s.startswith(p, i)
                            and not (i + len(p) < n and s[i + len(p)].isalpha())), None)
                if hit:
                    parts.append(s[start:i])
                    i += len(hit)
                    start = i
                    continue
            if i + 1 < n and s[i + 1] in "{}":
                depth += 1 if s[i + 1] == "{" else -1
                i += 2
                continue
            i += 1
            while i < n and s[i].isalpha():
                i += 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            hit = next((p for p in seps if not p.startswith("\\") and s.startswith(p, i)), None)
            if hit:
                parts.append(s[start:i])
                i += len(hit)
                start = i
                continue
        i += 1
    parts.append(s[start:])
    return parts


def _wrapped(s: str) -> str | None:
    """The bracket kind if `s` is one bracketed group `(..)`, `[..)`, `\\{..\\}`, `{..}`."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _match_close(s, 0) == len(s) - 1:
        return s[0] + s[-1]
    if s.startswith("\\{") and s.endswith("\\}") and _match_set_close(s) == len(s) - 2:
        return "\\{\\}"
    if s.startswith("{") and s.endswith("}") and _match_close(s, 0) == len(s) - 1:
        return "{}"
    if s.startswith("\\langle") and s.endswith("\\rangle"):
        return "<>"
    return None


def _match_set_close(s: str) -> int:
    depth, i = 0, 0
    while i < len(s):
        if s.startswith("\\{", i):
            depth += 1
            i += 2
            continue
        if s.startswith("\\}", i):
            depth -= 1
            if depth == 0:
                return i
            i += 2
            continue
        i += 1
    return -1


# ----------------------------------------------------------------------------------- leaf level

_TEXT_ANY = re.compile(r"\\(?:text|textnormal|textup|hbox|mbox|textbf|textrm|textit|textsf|texttt|emph|"
                       r"operatorname)\s*"
                       r"\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])|"
                      r"\bdegrees?\b|\bdeg\b")
_PERCENT = re.compile(r"\\%|%|\bpercent\b|\bpct\b")
_UNIT_WORDS = (
    "units?|square units?|sq units?|cm|mm|km|meters?|metres?|inches|inch|feet|foot|ft|yards?|yd|"
    "miles?|mi|seconds?|sec|minutes?|mins?|hours?|hrs?|days?|weeks?|months?|years?|yrs?|mph|kph|"
    "kmh|kg|grams?|mg|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|gallons?|dollars?|cents?|"
    "people|persons?|students?|ways?|points?|cubic|square|sq|m|s|g|l"
)
_UNIT_TAIL = re.compile(r"(?:(?<=[\d}\s)])|^)(?P<sp>\s*)(?:\\text\{\s*)?(?P<unit>" + _UNIT_WORDS +
                        r")\.?(?:\s*\})?(?P<pow>\s*\^\s*\{?[23]\}?)?\s*$")
_BASE_SUBSCRIPT = re.compile(r"(?<![A-Za-z0-9_}])(\d+)_\{?(\d+)\}?")
_LEADING_DOT = re.compile(r"(?<![\d}\w])\.(\d)")
_WORDS_ONLY = re.compile(r"\(?[A-Za-z][A-Za-z\s'\-.,!?()]*")


def _unwrap_text(s: str) -> str:
    return _TEXT_ANY.sub(r"\1", s)


def _text_key(s: str) -> str:
    t = _unwrap_text(s).strip().lower()
    t = re.sub(r"^\(([a-z])\)$", r"\1", t)  # (C) -> c
    t = re.sub(r"\s+", " ", t).strip(" .,;:!")
    return t


def _as_text(s: str) -> Text | None:
    """A text answer: words only once `\\text{}` is unwrapped (``\\text{Evelyn}``, ``Even``,
    ``\\textbf{(B)}``); a single bare letter stays math (it may be a variable)."""
    had_wrapper = bool(_TEXT_ANY.search(s))
    inner = _unwrap_text(s).strip()
    if not inner or not _WORDS_ONLY.fullmatch(inner) or "\\" in inner:
        return None
    letters = re.sub(r"[^A-Za-z]", "", inner)
    if not had_wrapper and (len(letters) < 3 or not re.search(r"[A-Za-z]{3,}", inner)):
        return None
    if not had_wrapper and re.fullmatch(r"(?:pi|infty|sqrt|frac|ldots)", inner):
        return None
    return Text(_text_key(inner))


#: Chinese and Japanese measure words and units after a number ("5个", "12 元", "3天"): up to four
#: CJK characters closing the leaf.
_CJK_UNIT = re.compile(r"(?<=[\d}\s])\s*[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]{1,4}\s*$")


def _strip_units(s: str) -> str:
    if re.match(r"-?\d", s):
        s = _CJK_UNIT.sub("", s)
    # words in \text{} next to math are units or prose ("17\text{ any text}", "15\mbox{ cm}^2");
    # a \text{} holding math (\text{13}) is unwrapped instead
    def repl(m: re.Match) -> str:
        inner = m.group(1)
        return " " if re.fullmatch(r"[A-Za-z\s.'\-]*", inner) else inner

    s2 = re.sub(r"(?:\\(?:text|textnormal|textup|hbox|mbox|textbf|textrm|textit|textsf|texttt|emph)"
                r"\s*\{([^{}]*)\})"
                r"(?:\s*\^\s*\{?[23]\}?)?", repl, s)
    if s2.strip():
        s = s2
    for _ in range(3):
        m = _UNIT_TAIL.search(s)
        if not m or not s[:m.start()].strip():
            break
        if len(m.group("unit")) == 1 and not m.group("pow") and not (
                m.group("sp") and s[:m.start()].rstrip().endswith(tuple("0123456789"))):
            break  # `2m` is an algebraic answer; only `10 m` / `10m^2` is a unit
        s = s[:m.start()]
    return s.strip()


_CLOCK = re.compile(r"(\d{1,2}):(\d{2})(?::(\d{2}))?\s*(?:([AaPp])\.?\s?[Mm]\.?|(noon|midnight))?")
_MIXED = re.compile(r"(-?)(\d+)\s+(\d+)\s*/\s*(\d+)")


def _clock(s: str) -> Clock | None:
    """A time of day: ``H:MM`` with two-digit minutes below 60 (optionally ``:SS`` and
    a.m./p.m., also inside ``\\text{}``). Times are their own kind of answer: ``5:30`` is neither
    the ratio 1:6 nor the decimal 5.30, and two different times are never equal."""
    m = _CLOCK.fullmatch(_unwrap_text(s).strip().rstrip("."))
    if m is None:
        return None
    h, mins, secs, mer = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), m.group(4)
    if m.group(5):  # 12:00 noon is 12:00 p.m.; 12:00 midnight is 12:00 a.m.
        mer = "p" if m.group(5) == "noon" else "a"
    if mins >= 60 or secs >= 60 or h > 24 or (mer and not 1 <= h <= 12):
        return None
    if mer:
        mer = mer.lower() + "m"
        h = h % 12 + (12 if mer == "pm" else 0)
    elif h == 0 or h > 12:
        mer = "24h"  # 17:30 names one time of day; only 1:00-12:59 is ambiguous
    return Clock((h * 60 + mins) * 60 + secs, mer)


def _mixed_number(s: str) -> str:
    """``2 1/2`` (a whole number, a space, a proper fraction) is the mixed number 5/2, as in
    ``2\\frac12``: the only reading of that spelling in an answer."""
    m = _MIXED.fullmatch(s)
    if m is None:
        return s
    sign, whole, num, den = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
    if not 0 < num < den:
        return s
    return f"{sign}\\frac{{{whole * den + num}}}{{{den}}}"


def _leaf(s: str) -> Leaf:
    percent = bool(_PERCENT.search(s))
    if percent:
        s = _PERCENT.sub(" ", s)
    degrees = bool(_DEGREES.search(s))
    if degrees:
        s = _DEGREES.sub(" ", s)
    s = _strip_units(s)
    s = _BASE_SUBSCRIPT.sub(r"\1", s)
    s = _LEADING_DOT.sub(r"0.\1", s)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    s = _mixed_number(s)
    if not s:
        raise NormalizeError("empty answer")
    return Leaf(s, percent, degrees)


# ------------------------------------------------------------------------------------ structure

_THOUSANDS_PLAIN = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_THOUSANDS_SPACE = re.compile(r"-?\d{1,3}(?: \d{3})+(?:\.\d+)?")
_AND_OR = re.compile(r"\\(?:text|mbox|textrm|textbf)\s*\{\s*(?:and|or)\s*\}|(?<![A-Za-z\\])(?:and|or)"
                     r"(?![A-Za-z])")
_INEQ = ("<", ">", "\\leq", "\\geq", "\\neq")
_LABEL_TEXT = re.compile(r"[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?'?(?:\([A-Za-z]\))?")
MAX_ITEMS = 64


_LABEL = r"\(([a-h]|i{1,3}|iv|vi{0,3})\)"
_PART = re.compile(r"(?:\\text(?:bf)?\{[\s,;]*(?:and\s*)?" + _LABEL + r"[\s:]*\}"
                   r"|(?<![A-Za-z0-9\\_^{])" + _LABEL +
                   r")\s*:?")
_PART_SCHEMES = ("abcdefgh", ("i", "ii", "iii", "iv", "v", "vi", "vii", "viii"))


def _parts(s: str) -> list[str] | None:
    """``(a) 3, (b) 4`` / ``\\text{(a) } 3 \\text{ (b) } 4``: the answers of named parts, in
    order, when the answer opens with the first label and the labels run (a), (b), ... (or
    (i), (ii), ...). Parts are ordered: swapping them is a different answer."""
    marks = list(_PART.finditer(s))
    if len(marks) < 2 or s[:marks[0].start()].strip():
        return None
    labels = [m.group(1) or m.group(2) for m in marks]
    if not any(list(sc[:len(labels)]) == labels for sc in _PART_SCHEMES):
        return None
    pieces = [s[m.end():(marks[k + 1].start() if k + 1 < len(marks) else len(s))]
              for k, m in enumerate(marks)]
    pieces = [re.sub(r"(?:[,;]|\\text\{\s*(?:and)?\s*\}|\band\b|\s)+$", "", p).strip() for p in pieces]
    return pieces if all(pieces) else None


def parse(s: str) -> Node:
    """The structure of a canonical answer (`canonical(s)` first)."""
    s = s.strip()
    if not s:
        raise NormalizeError("empty answer")
    parts = _parts(s)
    if parts is not None:
        return _seq("tuple", [parse(p) for p in parts])
    text = _as_text(s)
    if text is not None:
        return text
    parts = [p for p in split_top(s, (";",)) if p.strip()]
    if len(parts) > 1:
        return _seq("list", [_parse_list(p) for p in parts])
    return _parse_list(s)


def _seq(kind: str, items: list[Node]) -> Seq:
    if kind in ("list", "set"):
        flat: list[Node] = []
        for it in items:
            flat.extend(it.items if isinstance(it, Seq) and it.kind == "pm" else (it,))
        items = flat
    if len(items) > MAX_ITEMS:
        raise NormalizeError(f"more than {MAX_ITEMS} items")
    return Seq(kind, tuple(items))


def _parse_list(s: str) -> Node:
    s = s.strip()
    probe = _strip_units(_PERCENT.sub("", _DEGREES.sub("", s))).strip()
    if _THOUSANDS_PLAIN.fullmatch(probe) or _THOUSANDS_SPACE.fullmatch(probe):
        s = s.replace(",", "").replace(probe, probe.replace(" ", "").replace(",", ""))
        s = re.sub(r"(?<=\d) (?=\d{3})", "", s)
    s = _AND_OR.sub(",", s)
    parts = [p for p in split_top(s, (",",)) if p.strip()]
    if not parts:
        raise NormalizeError("empty answer")
    if len(parts) > 1:
        return _seq("list", [_parse_item(p) for p in parts])
    return _parse_item(parts[0])


def _parse_item(s: str) -> Node:
    s = s.strip()
    if not s:
        raise NormalizeError("empty item")
    if s == "\\ldots":
        return Dots()
    clock = _clock(s)
    if clock is not None:
        return clock

    parts = split_top(s, ("\\approx",))
    if len(parts) > 1:
        first = parts[0].strip()
        # `x \approx 11`: the value follows; `\frac13 \approx 0.33`: the exact value counts
        s = parts[1].strip() if (not first or _LABEL_TEXT.fullmatch(first)) else first
        if not s:
            raise NormalizeError("empty item")

    parts = split_top(s, ("=",))
    if len(parts) > 1:
        if any(not p.strip() for p in parts):
            raise NormalizeError("empty side of '='")
        label = bool(_LABEL_TEXT.fullmatch(parts[0].strip()))
        return Chain(tuple(_parse_item(p) for p in parts), label)

    parts = split_top(s, ("\\in",))
    if len(parts) == 2 and parts[0].strip() and parts[1].strip():
        return Member(_parse_item(parts[0]), _parse_item(parts[1]))

    parts = split_top(s, ("\\cup",))
    if len(parts) > 1:
        return Union(tuple(_parse_item(p) for p in parts))

    if any(len(split_top(s, (op,))) > 1 for op in _INEQ):
        return Rel(s)

    for pm, signs in (("\\pm", ("+", "-")), ("\\mp", ("-", "+"))):
        parts = split_top(s, (pm,))
        if len(parts) == 2:
            a, b = parts[0].strip(), parts[1].strip()
            # kind "pm": a list that merges into an enclosing list ({1 \pm \sqrt5, -2})
            return _seq("pm", [_parse_item(f"{a} {sg} {b}".strip()) for sg in signs])

    kind = _wrapped(s)
    if kind in ("()", "[]", "(]", "[)"):
        inner = s[1:-1]
        elems = [e for e in split_top(inner, (",", ";"))]
        if len(elems) == 1:
            if kind == "()":
                return _parse_item(inner)
            return _parse_item(inner) if kind == "[]" else _fail(s)
        if any(not e.strip() for e in elems):
            raise NormalizeError("empty element")
        items = [_parse_item(e) for e in elems]
        if kind != "()" and len(items) == 2:
            return Interval(kind[0], items[0], items[1], kind[1])
        return _seq("tuple", items)
    if kind == "\\{\\}":
        inner = s[2:-2].strip()
        if not inner:
            return Seq("set", ())
        return _seq("set", [_parse_item(e) for e in split_top(inner, (",", ";")) if e.strip()])
    if kind == "{}":
        return parse(s[1:-1])
    if kind == "<>":
        inner = s[len("\\langle"):-len("\\rangle")]
        return _seq("tuple", [_parse_item(e) for e in split_top(inner, (",",)) if e.strip()])
    if s in ("\\emptyset", "\\varnothing", "\\{\\}"):
        return Seq("set", ())

    text = _as_text(s)
    if text is not None:
        return text
    return _leaf(s)


def _fail(s: str) -> Node:
    raise NormalizeError(f"cannot read {s!r}")
