"""Notations for a number or a matrix that mean one thing but are spelled in several ways: decimal
commas, matrices as nested bracketed lists, matrices written with doubled backslashes.

Pure string work, called by `normalize.canonical` (matrices) and `equivalence.judge` (decimal
commas, which need to know what the other side is). Each rule and its guard is in docs/grading.md.
"""

from __future__ import annotations

import re

__all__ = ["decimal_comma", "undouble", "list_matrix"]

# ------------------------------------------------------------------------------ decimal commas

#: A number with a comma: integer part (maybe grouped by "." or spaces, "1.234,56", "12 345,6"),
#: the comma (or LaTeX `{,}`), the digits after it.
_COMMA_NUMBER = re.compile(r"(?P<sign>-?)\s*(?P<int>\d{1,3}(?:[. ]\d{3})+|\d+)(?P<sep>,|\{,\})(?P<frac>\d+)")
_NAME_EQ = re.compile(r"[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?\s*=\s*")
#: What may follow the number in a one-number answer: a unit, a percent or degree sign, words.
_UNIT_REST = re.compile(r"(?:\s|\\%|%|\\text\s*\{[^{}\d]*\}|\\mbox\s*\{[^{}\d]*\}|\^\s*\{?\\circ\}?|"
                        r"[A-Za-z.]|\^\s*\{?[23]\}?)*")


def decimal_comma(s: str, strict: bool = False) -> str | None:
    """`s` with its decimal comma written as a point, when `s` is one number with a decimal comma
    (optionally followed by a unit, percent or degree sign), else None.

    A comma is a decimal comma when it is not a thousands separator: it is followed by anything
    other than exactly three digits (``3,5``, ``12,75``, ``0,0625``), or the integer part is 0
    (``0,125``) or longer than three digits (``1234,5``), or the integer part is itself grouped
    (``1.234,56``, ``12 345,6``), or it is LaTeX's ``{,}`` (what ``3{,}5`` means in German
    typesetting; ``1{,}000`` was already removed as a thousands separator). ``1,234`` is never
    read here: it stays the thousands-separated 1234.

    `strict` (for a reference answer) accepts only the spellings that cannot be a list of two
    numbers: ``{,}`` and a grouped integer part. A bare ``1,2`` gold is the list 1, 2.
    """
    name = _NAME_EQ.match(s.strip())  # `x = 3,5`: the value of a named unknown
    s = s.strip()[name.end():] if name else s.strip()
    m = _COMMA_NUMBER.match(s)
    if m is None:
        return None
    rest = s[m.end():]
    if _UNIT_REST.fullmatch(rest) is None:
        return None
    whole, frac, grouped = m.group("int"), m.group("frac"), not m.group("int").isdigit()
    latex = m.group("sep") != ","
    if strict and not (latex or grouped):
        return None
    if not (latex or grouped or len(frac) != 3 or whole == "0" or len(whole) > 3):
        return None  # `1,234`: a thousands separator
    digits = re.sub(r"[. ]", "", whole)
    return f"{name.group(0) if name else ''}{m.group('sign')}{digits}.{frac}{rest}"


# ------------------------------------------------------------------------------------ matrices

# `\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}`: an answer copied with every backslash
# doubled (a JSON or Python string escaped twice), recognised by a doubled `\\begin{`/`\\end{`.
_DOUBLED_ENV = re.compile(r"(?<!\\)\\\\(?:begin|end)\{")


def undouble(s: str) -> str:
    """`s` with doubled backslashes halved, when it spells an environment with doubled
    backslashes (`\\\\begin{pmatrix}`): its row separators are then four backslashes, not a
    doubled row break. Any other text is returned as it is."""
    if not _DOUBLED_ENV.search(s):
        return s
    return re.sub(r"\\\\", r"\\", s)


_LIST_MATRIX = re.compile(r"\[\s*(\[[^\[\]]*\](?:\s*,\s*\[[^\[\]]*\])+)\s*\]")


def _split_items(row: str) -> list[str]:
    """Split a row at commas outside (), {} (`\\frac{1}{2}, (3)` is two items)."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(row):
        if c in "({":
            depth += 1
        elif c in ")}":
            depth -= 1
        elif c == "," and depth == 0:
            items.append(row[start:i].strip())
            start = i + 1
    items.append(row[start:].strip())
    return items


def list_matrix(s: str) -> str:
    """A matrix written as a bracketed list of bracketed rows, ``[[1, 2], [3, 4]]`` (NumPy and
    Python style), as ``\\begin{pmatrix}1 & 2\\\\3 & 4\\end{pmatrix}``; otherwise `s` unchanged.

    Guard: at least two rows, all of the same length, no empty entry. An outer bracket around
    bracketed pairs has no other reading (an interval's ends are numbers, not intervals), while
    ``[1, 2], [3, 4]`` without it stays two intervals."""
    m = _LIST_MATRIX.fullmatch(s.strip())
    if m is None:
        return s
    rows = [_split_items(r) for r in re.findall(r"\[([^\[\]]*)\]", m.group(1))]
    if len({len(r) for r in rows}) != 1 or any(not x for r in rows for x in r):
        return s
    return "\\begin{pmatrix}" + "\\\\".join(" & ".join(r) for r in rows) + "\\end{pmatrix}"
