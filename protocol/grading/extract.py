"""Answer extraction from model output: pure string work, linear in the length of the text.

Rules, tried in this order; the name of the one that fired is returned with the answer:

``boxed``
    The last *group* of complete ``\\boxed{...}`` / ``\\fbox{...}`` (brace matching, nested braces,
    ``\\boxed 5``). Boxes separated only by a connector (nothing, punctuation, ``\\quad``, "and",
    "or", "for part (a) and", ...) form one group and are joined with ", ", so
    ``\\boxed{898} \\boxed{900}`` gives ``898, 900``, never ``898900``; identical repeats are kept
    once. A "final answer is ..." statement *after* the last box wins over the box (models that box
    intermediate values and state the result at the end).
``final_answer``
    "final answer is ...", "the answer is ...".
``answer``
    "Answer: ..." (or a text that starts with "Answer").
``math``
    The last group of math spans (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``).
``is``
    Plain text without math: the few words after the last " is ".
``bare``
    A short text with none of the above is taken whole (``\\frac{13}{6}``, ``(8,-2)``, ``Navin``),
    unless it reads as prose (five or more plain words: a cut-off sentence is no answer).

Everything is linear: one pass computes all brace matches, math spans are found with forward
`str.find` calls only, and every regex is free of nested quantifiers.
"""

from __future__ import annotations

import re

__all__ = ["extract_answer", "find_boxes", "math_spans", "RULES"]

RULES = ("boxed", "final_answer", "answer", "math", "is", "bare")

#: Only the last this many characters of an output are searched (a final answer sits at the end;
#: R1-style traces at 32k tokens are ~130k characters). Keeps extraction of hostile multi-megabyte
#: outputs in the caller's process to a few tens of milliseconds.
MAX_SCAN_CHARS = 262_144
#: A bare answer longer than this is prose, not an answer.
BARE_MAX_CHARS = 300
#: A bare text with this many plain words is prose (a cut-off sentence), not an answer.
PROSE_WORDS = 5
#: How far after "Answer:" / "final answer is" the answer is looked for.
SEGMENT_MAX_CHARS = 2000

_CHAT_STOP = re.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>|<｜end▁of▁sentence｜>")
_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_FINAL_IS = re.compile(r"(?i)\b(?:final\s+answer|the\s+answer)\s+(?:is|was|would\s+be|will\s+be)\b\s*:?")
_ANSWER_COLON = re.compile(r"(?i)\banswer\s*\**\s*[:：]")
_ANSWER_START = re.compile(r"(?i)^\s*\**\s*answer\b\s*\**")
_HOPE = re.compile(r"(?i)\s*I\s+hope\s+it\s+is\s+correct.*$", re.S)
_IS_WORD = re.compile(r"(?i)\b(?:is|are|equals|be)\s+")
_SENTENCE_END = re.compile(r"(?<![0-9])\.(?![0-9])|\n")
_CONNECTOR_WORDS = re.compile(r"[A-Za-z()']+")
_WORD = re.compile(r"[A-Za-z]{2,}[.,;:!?]?")
_TEXT_CMD = re.compile(r"\\(?:text|mbox|textbf|textrm|mathrm|textit)\s*\{([^{}]*)\}")


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


def _is_connector(gap: str) -> bool:
    """Whether the text between two boxes/spans joins them into one answer ("x and y")."""
    if len(gap) > 80:
        return False
    g = _TEXT_CMD.sub(r" \1 ", gap)
    g = re.sub(r"\\q?quad|\\[,;:! ]|\\\\|\\\[|\\\]|\\\(|\\\)|[$*]", " ", g)
    g = g.strip()
    if not g:
        return True
    if re.fullmatch(r"[\s,;]+", g):
        return True
    if re.search(r"[.!?:](\s|$)", g):
        return False  # a sentence ends between them: separate statements
    words = _CONNECTOR_WORDS.findall(g)
    if not words or len(words) > 6:
        return False
    last = words[-1].lower()
    return last in ("and", "or") or g.endswith(",")


def _group(items: list[tuple[int, int, str]], text: str) -> list[tuple[int, int, str]]:
    """The last run of `items` whose gaps are connectors."""
    group = [items[-1]]  # built backwards, reversed at the end
    for prev in reversed(items[:-1]):
        if _is_connector(text[prev[1]:group[-1][0]]):
            group.append(prev)
        else:
            break
    group.reverse()
    return group


def _join(contents: list[str]) -> str:
    out: list[str] = []
    for c in contents:
        c = c.strip()
        if c and (not out or out[-1] != c):  # `\boxed{004} ... \boxed{004}`: once
            out.append(c)
    return ", ".join(out)


def _starts_with_math(seg: str) -> bool:
    return seg.startswith(("$", "\\(", "\\["))


def _refine(seg: str) -> str | None:
    """The answer inside the text that follows "final answer is" / "Answer:"."""
    seg = _HOPE.sub("", seg)
    para = seg.find("\n\n")
    lead = seg.lstrip()
    if para >= 0 and not _starts_with_math(lead):
        seg = seg[:para]
    seg = seg.strip().lstrip(":：").strip()
    if not seg:
        return None
    if _starts_with_math(seg):
        spans = math_spans(seg)
        if spans and spans[0][0] == 0:
            # the span that opens the segment, plus spans joined to it by connectors ("or", ",")
            group = [spans[0]]
            for nxt in spans[1:]:
                if not _is_connector(seg[group[-1][1]:nxt[0]]):
                    break
                group.append(nxt)
            return _join([c for _, _, c in group]) or None
    # "The largest $n$ is 34." -> the words after the last " is " carry the value
    outside = _mask_math(seg)
    last_is = None
    for m in _IS_WORD.finditer(outside):
        last_is = m
    if last_is is not None:
        seg = seg[last_is.end():]
    spans = math_spans(seg)
    if spans:
        return _join([c for _, _, c in _group(spans, seg)]) or None
    seg = _SENTENCE_END.split(seg, maxsplit=1)[0]
    seg = seg.strip().rstrip(".,;:")
    return seg or None


def _mask_math(text: str) -> str:
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


def _last(pattern: re.Pattern, text: str):
    m = None
    for m in pattern.finditer(text):
        pass
    return m


def _clean(text: str) -> str:
    stop = _CHAT_STOP.search(text)
    if stop and stop.start() > 0:
        text = text[:stop.start()]
    return text


def extract_answer(text: str | None) -> tuple[str | None, str | None]:
    """(answer, rule) for a model output, or (None, None) when it holds no answer."""
    if not text or not isinstance(text, str):
        return None, None
    if len(text) > MAX_SCAN_CHARS:
        text = text[-MAX_SCAN_CHARS:]
    text = _clean(text)
    think = text.rfind("</think>")
    if think >= 0:
        ans = _extract(text[think + len("</think>"):])
        if ans[0] is not None:
            return ans
    return _extract(text)


def _extract(text: str) -> tuple[str | None, str | None]:
    if not text.strip():
        return None, None
    boxes = find_boxes(text)
    if boxes:
        group = _group(boxes, text)
        after = text[group[-1][1]:]
        m = _last(_FINAL_IS, after)
        if m is not None:
            ans = _refine(after[m.end():m.end() + SEGMENT_MAX_CHARS])
            if ans:
                return ans, "final_answer"
        ans = _join([c for _, _, c in group])
        if ans:
            return ans, "boxed"

    m = _last(_FINAL_IS, text)
    if m is not None:
        ans = _refine(text[m.end():m.end() + SEGMENT_MAX_CHARS])
        if ans:
            return ans, "final_answer"

    m = _last(_ANSWER_COLON, text) or _ANSWER_START.match(text)
    if m is not None and m.end() < len(text):
        ans = _refine(text[m.end():m.end() + SEGMENT_MAX_CHARS])
        if ans:
            return ans, "answer"

    spans = [s for s in math_spans(text) if s[2].strip()]
    if spans:
        ans = _join([c for _, _, c in _group(spans, text)])
        if ans:
            return ans, "math"

    m = _last(_IS_WORD, text)
    if m is not None:
        rest = _SENTENCE_END.split(text[m.end():m.end() + 200], maxsplit=1)[0].strip().rstrip(".,;:")
        if rest and len(rest.split()) <= 4:
            return rest, "is"

    bare = text.strip()
    if len(bare) <= BARE_MAX_CHARS and "\n\n" not in bare and not _is_prose(bare):
        bare = bare.replace("$", " ").strip().rstrip(".").strip()
        if bare:
            return bare, "bare"
    return None, None


def _is_prose(text: str) -> bool:
    """A sentence rather than an answer ("I ran out of tokens while"): five or more plain words.
    Words inside \\text{} are an answer's own words and do not count."""
    outside = _TEXT_CMD.sub(" ", text)
    words = [t for t in outside.split() if _WORD.fullmatch(t)]
    return len(words) >= PROSE_WORDS
