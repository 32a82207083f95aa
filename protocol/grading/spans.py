"""Where answers sit in a model output: boxes, math spans, and the runs of them that form one answer.

Pure string work, linear in the text: one pass matches all braces (`find_boxes`), math spans are
found with forward `str.find` calls only (`math_spans`). `box_group` gives the boxes that together
state the final answer (boxes in one clause, boxes answering labelled or named parts);
`docs/grading.md` explains each rule and its guard.
"""

from __future__ import annotations

import re

__all__ = ["find_boxes", "math_spans", "group_runs", "part_answer", "named_answer", "box_answer", "mask_math", "last_match", "is_connector",
           "join"]

_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_CONNECTOR_WORDS = re.compile(r"(?:[^\W\d_]|[()'])+")
#: "and"/"or" of the languages `multilingual` reads: "$x = 1$ o $x = 3$" is one answer, as in English.
_AND_OR = frozenset(("and", "or", "y", "o", "e", "et", "ou", "und", "oder", "и", "или", "或", "或者", "和",
                     "及", "または", "و", "أو", "या", "और"))
_TEXT_CMD = re.compile(r"\\(?:text|textnormal|mbox|textbf|textrm|mathrm|textit)\s*\{([^{}]*)\}")

def _escaped(text: str, i: int) -> bool:
    """True when text[i] is preceded by an odd run of backslashes (`\\{` is a literal brace)."""
    n = 0
    j = i - 1
    while j >= 0 and text[j] == "\\":
        n += 1
        j -= 1
    return n % 2 == 1


def _brace_matches(text: str) -> dict[int, int]:
    """{index of '{': index of its matching '}'} for every balanced, unescaped brace; one pass."""
    stack: list[int] = []
    match: dict[int, int] = {}
    for m in re.finditer(r"[{}]", text):
        i = m.start()
        if _escaped(text, i):
            continue
        if text[i] == "{":
            stack.append(i)
        elif stack:
            match[stack.pop()] = i
    return match


def find_boxes(text: str) -> list[tuple[int, int, str]]:
    """Outermost complete boxes as (start, end, content), in text order."""
    matches = None
    boxes: list[tuple[int, int, str]] = []
    for m in _BOX_CMD.finditer(text):
        if boxes and m.start() < boxes[-1][1]:
            continue  # nested inside the previous box: the outer one is the answer
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            if matches is None:
                matches = _brace_matches(text)
            close = matches.get(j)
            if close is None:
                continue  # incomplete box (truncated output)
            boxes.append((m.start(), close + 1, text[j + 1:close]))
        elif j > m.end():
            # `\boxed 5`: one token up to whitespace or a math delimiter
            k = j
            while k < len(text) and not text[k].isspace() and text[k] not in "$\\":
                k += 1
            token = text[j:k].rstrip(".,;")
            if token:
                boxes.append((m.start(), k, token))
    return boxes


def math_spans(text: str) -> list[tuple[int, int, str]]:
    """Complete math spans as (start, end, content): `$$..$$`, `$..$`, `\\(..\\)`, `\\[..\\]`.

    `\\$` is a literal dollar. Unclosed openers are skipped; once an opener has no closer, no later
    opener of that kind can have one, which keeps the scan linear.
    """
    spans = []
    i, n = 0, len(text)
    exhausted = set()
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            nxt = text[i + 1]
            if nxt in "([" and nxt not in exhausted:
                closer = "\\)" if nxt == "(" else "\\]"
                j = text.find(closer, i + 2)
                if j < 0:
                    exhausted.add(nxt)
                    i += 2
                    continue
                spans.append((i, j + 2, text[i + 2:j]))
                i = j + 2
                continue
            i += 2  # any other escape, `\$` included
            continue
        if c == "$":
            if text.startswith("$$", i):
                if "$$" in exhausted:
                    i += 2
                    continue
                j = text.find("$$", i + 2)
                if j < 0:
                    exhausted.add("$$")
                    i += 2
                    continue
                spans.append((i, j + 2, text[i + 2:j]))
                i = j + 2
                continue
            if "$" in exhausted:
                i += 1
                continue
            j = i + 1
            while True:
                j = text.find("$", j)
                if j < 0 or not _escaped(text, j):
                    break
                j += 1
            if j < 0:
                exhausted.add("$")
                i += 1
                continue
            spans.append((i, j + 1, text[i + 1:j]))
            i = j + 1
            continue
        i += 1
    return spans


_HEDGE_WORDS = frozenset(("or", "alternatively", "maybe", "perhaps", "possibly", "either"))


def is_connector(gap: str) -> bool:
    """Whether the text between two boxes/spans joins them into one answer.

    "x and y", "3 or 4", "3, or maybe 4": boxes in one clause are one statement, so they are
    graded together (a list must match as a whole; "3 or maybe 4" is credited for neither 3 nor
    4). A sentence end between them makes them separate statements: the later one is the
    answer ("3. Wait, recomputing: 4")."""
    if len(gap) > 80:
        return False
    g = _TEXT_CMD.sub(r" \1 ", gap)
    g = re.sub(r"\\q?quad|\\[,;:! ]|\\\\|\\\[|\\\]|\\\(|\\\)|[$*]", " ", g)
    g = g.strip()
    if not g:
        return True
    if re.fullmatch(r"[\s,;]+", g):
        return True
    ends = list(re.finditer(r"[.!?:](\s|$)", g))
    if ends:
        # a sentence ends between them: separate statements ("3. Wait, recomputing: 4"),
        # unless the next one opens with a hedge ("3. Alternatively, 4" offers two answers)
        first = _CONNECTOR_WORDS.findall(g[ends[-1].end():])
        return bool(first) and first[0].lower() in _HEDGE_WORDS and len(first) <= 6
    words = _CONNECTOR_WORDS.findall(g)
    if not words or len(words) > 6:
        return False
    lower = [w.lower() for w in words]
    return lower[-1] in _AND_OR or g.endswith(",") or bool(_HEDGE_WORDS.intersection(lower))


def group_runs(items: list[tuple[int, int, str]], text: str,
               named: bool = False) -> list[tuple[int, int, str]]:
    """The last run of `items` whose gaps are connectors. With `named` (boxes), the name that
    labels the next box is not part of the gap: "$x = \\boxed{2}$ or $x = \\boxed{-3}$" is one
    answer, "2, -3"."""
    group = [items[-1]]  # built backwards, reversed at the end
    for prev in reversed(items[:-1]):
        gap = text[prev[1]:group[-1][0]]
        if named:
            gap = gap[:-_NAME_WINDOW] + _NAME_BEFORE.sub("", gap[-_NAME_WINDOW:])
        if is_connector(gap):
            group.append(prev)
        else:
            break
    group.reverse()
    return group


# ------------------------------------------------------------------------------ named boxes

#: How far before a box its name is looked for, and the longest gap between two named boxes that
#: still answer one question ("$a = \\boxed{2}$. Then $a + b = 9$, so $b = \\boxed{7}$").
_NAME_WINDOW = 40
NAMED_GAP_MAX = 200
#: `x =`, `a_1 =`, `f(x) =` right before a box (math delimiters and spaces between).
_NAME_BEFORE = re.compile(r"(?:^|(?<=[^A-Za-z0-9\\_}]))(?P<name>[A-Za-z](?:_\{?[A-Za-z0-9]+\}?)?"
                          r"(?:\([A-Za-z]\))?)\s*=\s*(?:\$|\\\(|\\\[)?\s*$")


def _box_name(text: str, start: int) -> str | None:
    m = _NAME_BEFORE.search(text[max(0, start - _NAME_WINDOW):start].replace("$", " "))
    return m.group("name") if m else None


def named_answer(boxes: list[tuple[int, int, str]], text: str) -> str | None:
    """Boxes that answer *different* named unknowns ("$a = \\boxed{3}$ and $b = \\boxed{4}$")
    as one answer "a = 3, b = 4", in text order: a list of equations, so names decide which
    value is which (against `a = 3, b = 4` in any order) and the order decides against an
    unnamed tuple (`(3, 4)`, never `(4, 3)`). The last boxes count, back to the first one that
    has no name, repeats a name (a later `x = \\boxed{4}` corrects an earlier `x`), or is more
    than `NAMED_GAP_MAX` characters before the next. None unless two or more qualify."""
    run: list[tuple[str, str]] = []
    nxt = None
    for s, e, content in reversed(boxes):
        name = _box_name(text, s)
        if name is None or any(name == n for n, _ in run) or (nxt is not None and nxt - e > NAMED_GAP_MAX):
            break
        run.append((name, content.strip()))
        nxt = s
    if len(run) < 2:
        return None
    return ", ".join(f"{n} = {c}" for n, c in reversed(run))


def box_answer(boxes: list[tuple[int, int, str]], text: str) -> str:
    """The answer stated by the boxes of `text` (which end the text's final statement): boxes
    answering labelled parts as an ordered tuple, boxes naming different unknowns as a list of
    equations, else the last group of boxes in one clause joined with ", "."""
    parts = part_answer(boxes, text)
    if parts:
        return parts
    group = group_runs(boxes, text, named=True)
    named = named_answer(boxes, text)
    if named and named.count(" = ") >= len(group):
        return named
    return join([c for _, _, c in group])


def join(contents: list[str]) -> str:
    out: list[str] = []
    for c in contents:
        c = c.strip()
        if c and (not out or out[-1] != c):  # `\boxed{004} ... \boxed{004}`: once
            out.append(c)
    return ", ".join(out)


# ------------------------------------------------------------------------- multi-part answers

_SCHEMES = ("abcdefgh", ("i", "ii", "iii", "iv", "v", "vi", "vii", "viii"), "123456789")
_PART_LABEL = re.compile(
    r"(?i:\bpart\s*\(?([a-h1-9]|i{1,3}|iv|vi{0,3})\)?)(?![A-Za-z0-9])"
    r"|(?<![A-Za-z0-9\\_^{])\(([a-h]|i{1,3}|iv|vi{0,3})\)"
    r"|(?m:^[ \t*#]*([a-h])\)(?=\s))")


def part_answer(boxes: list[tuple[int, int, str]], text: str) -> str | None:
    """Boxes that answer the named parts of one question ("(a) ... \\boxed{3} (b) ... \\boxed{4}")
    as one ordered tuple "(3, 4)", in the parts' order.

    A question with several named parts has several answers; taking only the last box would
    grade part (b) alone, and joining them as an unordered list would credit swapped parts.
    Each labelled part is answered by the last box before the next label; labels must be
    lower-case letters, roman numerals, or "part N" (upper-case (A)-(E) are answer choices and
    "(1)" is an equation reference), distinct, and together the first k labels of one scheme.
    """
    if len(boxes) < 2:
        return None
    answers: dict[str, str] = {}
    label, prev_end = None, 0
    for s, e, content in boxes:
        found = None
        for m in _PART_LABEL.finditer(text, prev_end, s):
            found = m
        if found is not None:
            label = next(g for g in found.groups() if g).lower()
        if label is not None:
            answers[label] = content.strip()
        prev_end = e
    if len(answers) < 2 or label is None:
        return None
    for scheme in _SCHEMES:
        order = [x for x in scheme if x in answers]
        if len(order) == len(answers) and list(scheme[:len(order)]) == order:
            return "(" + ", ".join(answers[x] for x in order) + ")"
    return None



def mask_math(text: str) -> str:
    """`text` with math spans blanked (same length), so prose regexes do not look inside math."""
    spans = math_spans(text)
    if not spans:
        return text
    parts, last = [], 0
    for s, e, _ in spans:
        parts.append(text[last:s])
        parts.append(" " * (e - s))
        last = e
    parts.append(text[last:])
    return "".join(parts)


def last_match(pattern: re.Pattern, text: str):
    m = None
    for m in pattern.finditer(text):
        pass
    return m

