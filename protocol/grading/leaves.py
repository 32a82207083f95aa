"""Leaf-level normalisation: text answers, units, degrees and percent, clock times, mixed numbers,
base subscripts (pure string work, called by `normalize.parse` on each scalar)."""

from __future__ import annotations

import re

from protocol.grading.nodes import Clock, Leaf, NormalizeError, Text

__all__ = ["leaf", "as_text", "clock", "text_key", "strip_units", "DEGREES", "PERCENT"]


_TEXT_ANY = re.compile(r"\\(?:text|textnormal|textup|hbox|mbox|textbf|textrm|textit|textsf|texttt|emph|"
                       r"operatorname)\s*"
                       r"\{([^{}]*)\}")
DEGREES = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])|"
                      r"\bdegrees?\b|\bdeg\b")
PERCENT = re.compile(r"\\%|%|\bper\s?cent\b|\bpercentage(?:\s+points?)?\b|\bpct\b")
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


def text_key(s: str) -> str:
    t = _unwrap_text(s).strip().lower()
    t = re.sub(r"^\(([a-z])\)$", r"\1", t)  # (C) -> c
    t = re.sub(r"\s+", " ", t).strip(" .,;:!")
    return t


def as_text(s: str) -> Text | None:
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
    return Text(text_key(inner))


#: Chinese and Japanese measure words and units after a number ("5个", "12 元", "3天"): up to four
#: CJK characters closing the leaf.
_CJK_UNIT = re.compile(r"(?<=[\d}\s])\s*[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]{1,4}\s*$")


def strip_units(s: str) -> str:
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


def clock(s: str) -> Clock | None:
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


def leaf(s: str) -> Leaf:
    percent = bool(PERCENT.search(s))
    if percent:
        s = PERCENT.sub(" ", s)
    degrees = bool(DEGREES.search(s))
    if degrees:
        s = DEGREES.sub(" ", s)
    s = strip_units(s)
    s = _BASE_SUBSCRIPT.sub(r"\1", s)
    s = _LEADING_DOT.sub(r"0.\1", s)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    s = _mixed_number(s)
    if not s:
        raise NormalizeError("empty answer")
    return Leaf(s, percent, degrees)
