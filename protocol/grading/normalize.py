"""String normalisation of MATH answers and their structure (lists, tuples, intervals, relations).

Two stages, both pure string work (no sympy here):

* `canonical(s)` (`canonical.py`): one LaTeX spelling per meaning for the whole answer:
  ``\\dfrac``/``\\tfrac`` -> ``\\frac``, ``\\frac12`` -> ``\\frac{1}{2}``, no
  ``\\left``/``\\right``/spacing commands, thousands separators (``10,\\!080``, ``14{,}916``,
  ``1,000.99``, ``1 000``) removed, currency removed, relation spellings unified (``>=``,
  ``\\ge`` -> ``\\geq``), matrix environments -> ``pmatrix``.
* `parse(s)` (this module): a small tree of `Node` objects (`nodes.py`). Leaves keep LaTeX text
  (sympy conversion happens in `evaluate`, inside the worker); leaf-level normalisation
  (`leaves.py`) strips units, ``\\text{}`` words, degrees and percent (recorded as flags), base
  subscripts (``204_5`` -> ``204``).

The tree is what makes "ordered tuple vs unordered list", "interval vs inequality" and
"``x = 3`` vs ``3``" decidable; `equivalence` compares trees.
"""

from __future__ import annotations

import re

from protocol.grading.canonical import canonical, compact, match_close
from protocol.grading.leaves import DEGREES, PERCENT, as_text, clock, leaf, strip_units
from protocol.grading.nodes import (Chain, Clock, Dots, Interval, Leaf, Member, Node, NormalizeError, Rel, Seq,
                                    Text, Union)

__all__ = ["canonical", "compact", "parse", "MAX_ANSWER_CHARS", "Node", "Leaf", "Text", "Seq", "Interval", "Union",
           "Chain", "Member", "Rel", "Dots", "Clock", "NormalizeError"]


#: Longest answer (after extraction) that is parsed at all; longer ones are only compared as text.
MAX_ANSWER_CHARS = 5000


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
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and match_close(s, 0) == len(s) - 1:
        return s[0] + s[-1]
    if s.startswith("\\{") and s.endswith("\\}") and _match_set_close(s) == len(s) - 2:
        return "\\{\\}"
    if s.startswith("{") and s.endswith("}") and match_close(s, 0) == len(s) - 1:
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


# ------------------------------------------------------------------------------------ structure

_THOUSANDS_PLAIN = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_THOUSANDS_SPACE = re.compile(r"-?\d{1,3}(?: \d{3})+(?:\.\d+)?")
# "and"/"or" between items, also in the languages `multilingual` reads (not the one-letter ones,
# "y", "o", "e", which are variables in math)
_AND_OR = re.compile(r"\\(?:text|mbox|textrm|textbf)\s*\{\s*(?:and|or|et|ou|und|oder|y|o|e|и|или|或|和)\s*\}|(?<![A-Za-z\\])(?:and|or)"
                     r"(?![A-Za-z])|(?<![^\W\d_])(?:et|ou|und|oder|или|أو|या|और)(?![^\W\d_])|或者|或|和")
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
    text = as_text(s)
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
    probe = strip_units(PERCENT.sub("", DEGREES.sub("", s))).strip()
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
    time = clock(s)
    if time is not None:
        return time

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

    text = as_text(s)
    if text is not None:
        return text
    return leaf(s)


def _fail(s: str) -> Node:
    raise NormalizeError(f"cannot read {s!r}")
