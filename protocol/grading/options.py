"""Multiple-choice answers: a gold that names an option matches that option only.

MATH-500 has problems that list options ("(A) Line (B) Circle (C) Plane ...", or AMC's
``\\textbf{(A)}\\ 3(1 + r)^x = 7\\qquad ...``) and a gold that is a letter (``\\text{(C)}``). The
generic text rule lower-cases both sides, so a box holding the problem's constant ``c`` once
matched ``(C)``. Here the option is decided on its own:

* the **gold** is an option when it is an upper-case letter in brackets (``(C)``, ``\\text{(C)}``,
  ``\\textbf{(C)}``, ``C)``), possibly with the option's text (``(C) Plane``), or a bare upper-case
  letter (``C``, ``\\text{C}``) that the problem lists as an option; a list of them (``A, C``) asks
  for exactly those options;
* an **answer** names option C when it is ``C``, ``(C)``, ``C)``, ``C.``, ``\\text{(C)}``,
  ``\\textbf{(C)}``, ``C) Plane``, "option C", or the option's content ("Plane", ``\\text{plane}``;
  for a math option, an expression equal to it, decided by the worker);
* a **lower-case letter** names an option only in a label's spelling: ``(c)``, ``c)`` followed by
  text, "option c", "choice (c)". A bare ``c`` is a variable (the problem's constant, say), never
  an option;
* anything else, a different letter, or a letter whose text is another option's content
  (``(C) Line`` when Line is (A)) is wrong.

Pure string work, in the calling process; only the comparison of an answer with a math option's
content goes to a worker.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.grading.leaves import text_key

__all__ = ["Choice", "Decision", "options_of", "option_gold", "named_letters"]

# An option label in a problem: (A), \textbf{(A)}, \text{(A)}, \mathrm{(A)}, or "A." / "A)" at a
# line start (MATH's "Enter the letters ..." problems).
_LABEL = re.compile(r"(?:\\(?:textbf|text|mathrm|mathbf|textrm)\s*\{\s*)?\(([A-J])\)(?:\s*\})?|"
                    r"(?m:^[ \t]*([A-J])[.)][ \t])")
_WRAPPER = re.compile(r"\\(?:textbf|text|mathrm|mathbf|textrm|textnormal|mbox|boxed)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\(?:qquad|quad|,|;|!|:| )|~|\$|\\\(|\\\)")
_ARTICLE = re.compile(r"^(?:the|a|an)\s+", re.I)
# A letter as an option label at the start of an answer: "(C)", "C)", "C.", "C:", "C" alone.
_LEAD = re.compile(r"\s*(?:(?:option|choice|answer)\s*:?\s*)?(?:\((?P<p>[A-Za-z])\)|(?P<b>[A-Za-z])(?P<mark>[).:])?)"
                   r"(?=\s|$|[,;])", re.I)


@dataclass(frozen=True)
class Decision:
    """What an answer means against an option gold: a `verdict`, or `compare_with` (an option's
    math content the answer must equal, judged by the worker) when the strings cannot decide."""

    verdict: bool | None
    compare_with: str | None = None


@dataclass(frozen=True)
class Choice:
    """A gold that names options: `letters` (upper case, sorted) and the problem's `options`
    as (letter, content) pairs (empty when the problem text is not known)."""

    letters: tuple[str, ...]
    options: tuple[tuple[str, str], ...] = ()

    def content(self, letter: str) -> str | None:
        return next((c for ltr, c in self.options if ltr == letter), None)

    def decide(self, answer: str) -> Decision:
        """Whether the extracted `answer` names exactly the gold's options."""
        named = named_letters(answer, dict(self.options))
        if named is not None:
            return Decision(named == self.letters)
        if len(self.letters) != 1 or not self.options:
            return Decision(False)
        key = _content_key(answer)
        hits = sorted(ltr for ltr, c in self.options if key and _content_key(c) == key)
        if hits:
            return Decision(hits == list(self.letters))
        mine = self.content(self.letters[0])
        if mine and not _is_words(mine) and not _is_words(_plain(answer)):
            return Decision(None, compare_with=mine)  # `\frac{2}{4}` against option `\frac12`
        return Decision(False)


def _plain(s: str) -> str:
    """`s` without text wrappers, math delimiters and spacing commands."""
    for _ in range(3):
        s = _WRAPPER.sub(r"\1", s)
    return re.sub(r"\s+", " ", _SPACING.sub(" ", s)).strip()


def _content_key(s: str) -> str:
    return _ARTICLE.sub("", text_key(_plain(s)).strip(" .")).strip()


def _is_words(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z\s'\-]*", s.strip()))


def options_of(problem: str | None) -> dict[str, str]:
    """The options a problem lists, letter -> content ("(A) Line\\n(B) Circle" gives
    {"A": "Line", "B": "Circle"}); labels must run A, B, C, ... from A, at least two of them,
    else there are none. The last option ends at its line end."""
    if not problem:
        return {}
    labels = list(_LABEL.finditer(problem))
    run: list[re.Match] = []
    for m in labels:  # the longest run A, B, C, ... (a lone "(A)" in the text is no option list)
        letter = m.group(1) or m.group(2)
        if letter == "A":
            run = [m]
        elif run and ord(letter) == ord(run[-1].group(1) or run[-1].group(2)) + 1:
            run.append(m)
    if len(run) < 2:
        return {}
    out = {}
    for k, m in enumerate(run):
        end = run[k + 1].start() if k + 1 < len(run) else len(problem)
        text = problem[m.end():end]
        if k + 1 == len(run) or "\n" in text.strip():
            text = text.strip().split("\n", 1)[0]
        out[m.group(1) or m.group(2)] = _plain(text).strip(" ,;")
    return out


def named_letters(answer: str, options: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """The options an answer names in a letter's spelling (sorted, upper case), or None when it
    is not written as option letters. A bare lower-case letter is a variable, not an option; a
    letter followed by text that is another option's content contradicts itself (no letters)."""
    items = [s for s in re.split(r"\s*(?:,|;|\band\b|\\text\{\s*and\s*\})\s*", _plain(answer)) if s.strip()]
    if not items:
        return None
    found = []
    for item in items:
        m = _LEAD.match(item)
        if m is None:
            return None
        letter = m.group("p") or m.group("b")
        rest = item[m.end():].strip()
        worded = bool(re.match(r"\s*(?:option|choice|answer)\b", item, re.I))
        labelled = bool(m.group("p")) or (m.group("mark") == ")" and bool(rest)) or worded
        if letter.islower() and not labelled:
            return None  # `c`, `c.`: the problem's variable, not option (C)
        if letter.isupper() and not (labelled or m.group("mark") or not rest):
            return None
        if rest and options:
            key = _content_key(rest)
            if any(_content_key(c) == key for ltr, c in options.items() if ltr != letter.upper()):
                return ()  # "(C) Line" when Line is (A): names no single option
        found.append(letter.upper())
    return tuple(sorted(set(found)))


_GOLD = re.compile(r"\s*(?:\((?P<p>[A-Z])\)|(?P<b>[A-Z])\))\s*(?P<rest>.*)", re.S)


def option_gold(gold: str, problem: str | None = None) -> Choice | None:
    """The `Choice` a gold names, or None when it is not an option: an upper-case letter in
    brackets (``(C)``, ``\\text{(C)}``, ``\\textbf{(C)}``, ``C)``, with or without the option's
    text), or a bare upper-case letter (or list of them: ``A, C``) that the problem lists."""
    options = options_of(problem)
    plain = _plain(gold)
    m = _GOLD.fullmatch(plain)
    if m is not None:
        letter = m.group("p") or m.group("b")
        if m.group("rest") and not options:  # "(C) Plane" without the problem: its own text
            options = {letter: m.group("rest").strip()}
        return Choice((letter,), tuple(sorted(options.items())))
    items = [s.strip() for s in re.split(r"\s*(?:,|\band\b)\s*", plain) if s.strip()]
    if items and options and all(re.fullmatch(r"[A-Z]", s) and s in options for s in items):
        return Choice(tuple(sorted(set(items))), tuple(sorted(options.items())))
    return None
