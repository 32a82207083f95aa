"""Answer extraction from model output: pure string work, linear in the length of the text.

First the text that can hold the final answer is cut out (`_clean`, `_final_part`): the model's
own turn (up to a chat-template marker that follows content), the part after ``</think>`` (an
unclosed ``<think>`` is a trace cut off before its answer), without markdown bold/headings.
Then rules, tried in this order; the name of the one that fired is returned with the answer:

``boxed``
    The last *group* of complete ``\\boxed{...}`` / ``\\fbox{...}`` (brace matching, nested
    braces, ``\\boxed 5``). Boxes in one clause (nothing, punctuation, ``\\quad``, "and", "or",
    a hedge such as "or maybe" or "Alternatively,") are one answer joined with ", ", so
    ``\\boxed{898} \\boxed{900}`` gives ``898, 900``, never ``898900``. Boxes that answer
    labelled parts ((a), (b), ...) form one ordered tuple. A "final answer is ..." statement
    *after* the last box wins; a number restated in a concluding sentence after a one-number box
    becomes a second stated answer (`Extraction.others`), and credit needs both.
``final_answer``
    "final answer is ...", "the answer is ...", or a "Final Answer" heading line.
``answer``
    "Answer: ..." (or a text that starts with "Answer").
``is``
    The value stated by the last sentence in prose ("there are 12 such numbers", "So the recipe
    needs 2 1/2 cups."), when no math comes after it.
``math``
    The last group of math spans (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``).
``bare``
    A short text with none of the above is taken whole (``\\frac{13}{6}``, ``(8,-2)``,
    ``Navin``), unless it reads as prose (five or more plain words: a cut-off sentence is no
    answer).

A truncated output (a sentence cut off after the last value) gives no answer from the prose and
math rules. Everything is linear: one pass computes all brace matches, math spans are found with
forward `str.find` calls only, the prose rules read only the last `SEGMENT_MAX_CHARS`, and every
regex is free of nested quantifiers. docs/grading.md lists every rule with the reason for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["extract_final", "extract_answer", "Extraction", "find_boxes", "math_spans", "RULES"]

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

#: End-of-turn and role markers of chat templates: any `<|...|>` special token (ChatML, Llama 3,
#: Phi, GPT), DeepSeek's `<｜...｜>`, `</s>`, `<eos>`, Gemma's turn markers, Mistral's `[INST]`, and
#: "Human:"/"User:"/"Assistant:" at a line start. Text after the first one that follows some
#: content belongs to another turn (a model running on past its end of sequence), never to this
#: answer.
_CHAT_STOP = re.compile(
    r"<\|[^|<>\s]{1,40}\|>|<｜[^｜<>\n]{1,40}｜>|</s>|<eos>|<end_of_turn>|<start_of_turn>|"
    r"\[INST\]|\[/INST\]|"
    r"(?m:^[ \t#*>]*(?:Human|HUMAN|User|USER|Assistant|ASSISTANT|### Instruction)[ \t*]*:)")
#: Few-shot continuations: a base model that answers, then writes the next "Question:", and the
#: bare role lines ("user", "assistant") that decoding with special tokens skipped leaves. Weaker
#: than a template token (a solution may restate "Problem:" first), so they end the answer only
#: when an answer (a box or an "answer" statement) comes before them.
_WEAK_STOP = re.compile(r"(?m:^[ \t#*>]*(?:Question|Problem|Q)[ \t*]*[:：])|"
                        r"(?m:^[ \t]*(?:user|assistant|model)[ \t]*$)")
_HAS_ANSWER = re.compile(r"(?i)\\boxed|\\fbox|\banswer\b")
_BOX_CMD = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_FINAL_IS = re.compile(r"(?i)\b(?:final\s+answer|the\s+answer)\s+(?:is|was|would\s+be|will\s+be)\b\s*:?")
_ANSWER_COLON = re.compile(r"(?i)\banswer\s*\**\s*[:：]")
_ANSWER_START = re.compile(r"(?i)^\s*\**\s*answer\b\s*\**")
_HOPE = re.compile(r"(?i)\s*I\s+hope\s+it\s+is\s+correct.*$", re.S)
_SENTENCE_END = re.compile(r"(?<![0-9])\.(?![0-9])|\n")
_CONNECTOR_WORDS = re.compile(r"[A-Za-z()']+")
_WORD = re.compile(r"[A-Za-z]{2,}[.,;:!?]?")
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


def _is_connector(gap: str) -> bool:
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
    return lower[-1] in ("and", "or") or g.endswith(",") or bool(_HEDGE_WORDS.intersection(lower))


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


# ------------------------------------------------------------------------- multi-part answers

_SCHEMES = ("abcdefgh", ("i", "ii", "iii", "iv", "v", "vi", "vii", "viii"), "123456789")
_PART_LABEL = re.compile(
    r"(?i:\bpart\s*\(?([a-h1-9]|i{1,3}|iv|vi{0,3})\)?)(?![A-Za-z0-9])"
    r"|(?<![A-Za-z0-9\\_^{])\(([a-h]|i{1,3}|iv|vi{0,3})\)"
    r"|(?m:^[ \t*#]*([a-h])\)(?=\s))")


def _part_answer(boxes: list[tuple[int, int, str]], text: str) -> str | None:
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


# ---------------------------------------------------------------------- answers stated in prose

_NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen".split())}
_NUMBER_WORDS.update({w: 10 * (i + 2) for i, w in enumerate(
    "twenty thirty forty fifty sixty seventy eighty ninety".split())})
_SCALES = {"hundred": 100, "thousand": 1000, "million": 10 ** 6}
_DENOMINATORS = {"half": 2, "halves": 2, "third": 3, "thirds": 3, "quarter": 4, "quarters": 4}
_DENOMINATORS.update({w + s: d for d, w in enumerate(
    "fourth fifth sixth seventh eighth ninth tenth".split(), start=4) for s in ("", "s")})
_CLOCK = r"\d{1,2}:\d{2}(?:\s*[ap]\.?\s?m\b\.?)?"
_NUMERAL = (r"-?\d{1,3}(?:(?:,| )\d{3})+(?:\.\d+)?(?![\d,])"  # 1,234 / 1 234 567
            r"|-?\d+\s+\d+\s*/\s*\d+"                         # 2 1/2 (a mixed number)
            r"|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_LEAD_NUMBER = re.compile(rf"\s*(?P<num>{_CLOCK}|{_NUMERAL})"
                          r"(?P<unit>\s*(?:%|\\%|per\s?cent\b|degrees?\b|°))?")
_IS_WORD = re.compile(r"(?i)\b(?:is|are|was|were|equals|be|get|gives)\s+|\bat\s+(?=\d{1,2}:\d{2})")


def _number_words(s: str) -> tuple[str, int] | None:
    """(digits, characters used) for an English cardinal at the start of `s` ("twenty-five",
    "one hundred and two"), or None. Answers in prose are often spelled out."""
    total = current = 0
    used = 0
    seen = False
    for m in re.finditer(r"\s*([A-Za-z]+)(-?)", s):
        if m.start() != used:
            break
        w = m.group(1).lower()
        if w in _NUMBER_WORDS:
            current += _NUMBER_WORDS[w]
        elif w in _SCALES and seen:
            if w == "hundred":
                current *= 100
            else:
                total += current * _SCALES[w]
                current = 0
        elif w == "and" and seen:
            pass
        else:
            break
        seen = seen or w in _NUMBER_WORDS
        used = m.end()
    if not seen or re.match(r"\s+of\b", s[used:]):
        return None  # "one of the roots" is a pronoun, not a number
    if s[:used].rstrip().lower().endswith("and"):
        used = s[:used].lower().rstrip().rfind("and")
    value = total + current
    m = re.match(r"[\s-]*([A-Za-z]+)", s[used:])
    den = _DENOMINATORS.get(m.group(1).lower()) if m else None
    if den is not None:  # "one half", "three-fourths"
        return f"{value}/{den}", used + m.end()
    return str(value), used


#: Words that may stand before a stated value: "is a 25% increase", "is about 3.5 hours".
_HEDGE_LEAD = re.compile(r"(?i)^\s*(?:a|an|the|about|approximately|roughly|around|exactly|only|just|"
                         r"precisely|equal to)\s+(?=[-\d.])")


def _prose_value(rest: str) -> str | None:
    """The answer at the start of prose that follows "is"/"are": a number keeps only what makes
    it a value (percent, degrees, a.m./p.m.), dropping the nouns after it ("12 such numbers" ->
    "12", "2 1/2 cups" -> "2 1/2", "twenty-five percent" -> "25%"); other text is kept when it is
    short (four words at most: "Evelyn", "the ellipse"), else there is no answer here."""
    rest = _HEDGE_LEAD.sub("", rest, count=1)
    m = _LEAD_NUMBER.match(rest)
    if m is not None:
        after = rest[m.end():]
        sentence = _SENTENCE_END.split(after, maxsplit=1)[0]
        if not re.search(r"\d", sentence):  # "3 and 4" is a list, not the number 3
            unit = m.group("unit") or ""
            return m.group("num").strip() + ("\\%" if "%" in unit or "cent" in unit else
                                            "^\\circ" if unit.strip() else "")
    words = _number_words(rest)
    if words is not None:
        digits, used = words
        unit = re.match(r"\s*(percent|per cent|degrees?)\b", rest[used:], re.I)
        return digits + ("" if unit is None else "^\\circ" if unit.group(1).startswith("deg")
                         else "\\%")
    seg = _SENTENCE_END.split(rest[:200], maxsplit=1)[0].strip().rstrip(".,;:")
    if m is not None or (seg and len(seg.split()) <= 4):
        return seg or None
    return None


#: The end of a complete sentence: a period that is not a decimal point, "!", "?", a line end.
_SENTENCE_STOP = re.compile(r"\.(?!\d)|[!?]|\n")


def _runs_on(rest: str) -> bool:
    """Whether the text after a value ends in a sentence that never ends: two or more words after
    the last period, "!", "?" or line end ("4 times the", "$x = 5$. So for n = 4 we"). That is
    an output cut off mid-sentence, whose last value is not its answer; a unit or currency sign
    alone after the value ("1,000.99€", "$28$ %", "5 cm") still ends it."""
    last = None
    for last in _SENTENCE_STOP.finditer(_no_meridiem_dots(rest)):
        pass
    fragment = rest if last is None else rest[last.end():]
    return len(re.findall(r"[A-Za-z]+", fragment)) >= 2


def _no_meridiem_dots(s: str) -> str:
    return re.sub(r"([ap])\.m\.", r"\1m.", s)  # "p.m." may also end the sentence


def _states_more(rest: str) -> bool:
    """Whether text after a sentence could state a value (a digit, math, a box): closing
    remarks without one ("I hope this helps!") do not displace the concluding sentence."""
    return bool(re.search(r"[0-9$\\]", rest))


def _numeric(value: str) -> bool:
    return bool(_LEAD_NUMBER.match(value))


def _statement(text: str) -> tuple[int, str] | None:
    """(position, value) of the value stated by the last "is"/"are"/"equals"/"gives" outside
    math, when it is in the last sentence of `text` ("Therefore, there are 12 such numbers.")."""
    masked = _mask_math(text)
    m = _last(_IS_WORD, masked)
    if m is None:
        return None
    value = _prose_value(text[m.end():m.end() + 200])
    if value is None:
        return None
    tail = text[m.end():]
    lead = _LEAD_NUMBER.match(_HEDGE_LEAD.sub("", tail, count=1))
    if _runs_on(tail if lead is None else _HEDGE_LEAD.sub("", tail, count=1)[lead.end():]):
        return None  # cut off mid-sentence ("the number of ways is 4 times the"): no statement
    end = _SENTENCE_END.search(_no_meridiem_dots(tail))
    if end is not None and _states_more(tail[end.end():]):
        return None  # a later sentence names a value: this is not the concluding statement
    return m.start(), value


_CONCLUSION = re.compile(r"(?i)(?:^|(?<=[.!?\n]))\s*(?:so|thus|therefore|hence|consequently|in total|in all|"
                         r"altogether|overall|finally)\b[ ,]*")
_ANY_NUMBER = re.compile(rf"(?<![\w.])(?:{_CLOCK}|{_NUMERAL})")


def _conclusion(text: str) -> tuple[int, str] | None:
    """(position, value) when the last sentence is a conclusion ("So", "Thus", "Therefore",
    "In total", ...) that names exactly one number outside math: "So the recipe needs 2 1/2
    cups." A concluding sentence with one number states the result whatever its verb; with
    two numbers, or without a conclusion word, it is not taken (it may be working)."""
    masked = _mask_math(text)
    m = _last(_CONCLUSION, masked)
    if m is None:
        return None
    sentence = masked[m.end():]
    end = _SENTENCE_END.search(_no_meridiem_dots(sentence))
    if end is not None and _states_more(sentence[end.end():]):
        return None  # a later sentence names a value
    numbers = list(_ANY_NUMBER.finditer(sentence))
    if len(numbers) != 1 or not _SENTENCE_STOP.search(_no_meridiem_dots(sentence)):
        return None  # two numbers (working), or cut off before the sentence ends
    value = _prose_value(text[m.end() + numbers[0].start():m.end() + numbers[0].start() + 200])
    return (m.start(), value) if value and _numeric(value) else None


_RESTATE = re.compile(r"(?i)\s*(?:so|thus|therefore|hence|consequently|in total|in all|altogether|"
                      r"overall|finally|actually|wait|but|correction)\b|.*\banswer\b")


def _single_number(ans: str) -> bool:
    """A boxed answer that is one number (`12`, `\\frac{3}{4}`, `2\\sqrt{3}`), the only kind a
    number restated after it can contradict: after `\\boxed{(1,2),(3,4)}`, "So there are 2
    pairs" counts the answer instead of restating it."""
    return bool(re.search(r"\d", ans)) and not re.search(
        r"[,;=(\[]|\\[{}]|matrix|\\cup|\\pm|[a-zA-Z]\s*$", ans)


def _tail(text: str) -> tuple[int, str]:
    """(offset, text) of the end of `text` in which a concluding sentence is looked for: the last
    `SEGMENT_MAX_CHARS`, from a line start so that no math span is cut in two. Keeps the prose
    rules linear in a short window whatever the output's length."""
    if len(text) <= SEGMENT_MAX_CHARS:
        return 0, text
    off = len(text) - SEGMENT_MAX_CHARS
    nl = text.find("\n", off)
    off = nl + 1 if 0 <= nl < len(text) - 1 else off
    return off, text[off:]


def _restatement(after: str) -> str | None:
    """A number restated in the concluding sentence after the last box ("\\boxed{12}. Thus there
    are 13 such numbers.", "... Actually, it should be 4."). The output then states two final
    answers, and credit needs both right. Only a sentence that concludes or corrects counts
    ("so", "thus", "actually", "wait", "the answer ..."): "The other root is 3, which we reject"
    is commentary."""
    masked = _mask_math(after)
    starts = [0] + [m.end() for m in _SENTENCE_END.finditer(re.sub(r"[ap]\.m\.", "pm", masked))
                    if _states_more(after[m.end():])]
    sentence = after[starts[-1]:]
    if not _RESTATE.match(_mask_math(sentence)):
        return None
    stated = _statement(sentence) or _conclusion(sentence)
    return stated[1] if stated and _numeric(stated[1]) else None


# ------------------------------------------------------------------------------------ refining

def _starts_with_math(seg: str) -> bool:
    return seg.startswith(("$", "\\(", "\\["))


def _refine(seg: str) -> str | None:
    """The answer inside the text that follows "final answer is" / "Answer:"."""
    seg = _HOPE.sub("", seg).lstrip(" \t:：")
    lead = seg.lstrip()
    if not _starts_with_math(lead):
        seg = lead  # the answer may be on the line after a "Final Answer" heading
    para = seg.find("\n\n")
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
    last_is = _last(_IS_WORD, outside)
    if last_is is not None:
        seg = seg[last_is.end():]
    spans = math_spans(seg)
    if spans:
        return _join([c for _, _, c in _group(spans, seg)]) or None
    value = _prose_value(seg)
    if value is not None and (_LEAD_NUMBER.match(seg) or _number_words(seg)):
        return value
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


# ------------------------------------------------------------------------------------ cleaning

def _clean(text: str) -> str:
    """The model's own turn: text up to the first chat-template marker that follows some
    content (a marker before any content, such as a leading "<|im_start|>assistant", is
    dropped), then up to the first few-shot "Question:" that follows an answer."""
    for m in _CHAT_STOP.finditer(text):
        if _CHAT_STOP.sub("", text[:m.start()]).strip():
            text = text[:m.start()]
            break
    text = _CHAT_STOP.sub("", text)
    for m in _WEAK_STOP.finditer(text):
        if _HAS_ANSWER.search(text, 0, m.start()):
            return text[:m.start()]
    return text


def _final_part(text: str) -> str | None:
    """The part of the output that holds the final answer, or None when there is none.

    Reasoning models write a scratchpad in `<think>...</think>` and the answer after it; boxes
    inside the scratchpad are tentative. So with a `</think>` only the text after the last one
    counts, and a `<think>` that is never closed is a trace cut off before its answer (no
    answer, even if it boxed a candidate on the way)."""
    close = text.rfind("</think>")
    if close >= 0:
        return text[close + len("</think>"):]
    if "<think>" in text:
        return None
    return text


_MARKDOWN = re.compile(r"\*\*|__|^[ \t]*#{1,6}[ \t]+", re.M)
_FINAL_HEADING = re.compile(r"(?im)^[ \t>]*(?:final\s+answer|answer)[ \t]*[:：]?[ \t]*$")


@dataclass(frozen=True)
class Extraction:
    """What an output states as its final answer: `answer` (None when nothing), the `rule`
    that found it, and `others`: further answers the output *also* states as final (a value
    restated after the box). Credit needs every one of them to be right."""

    answer: str | None
    rule: str | None
    others: tuple[str, ...] = ()


def extract_final(text: str | None) -> Extraction:
    """The final answer of a model output (see the module docstring for the rules)."""
    if not text or not isinstance(text, str):
        return Extraction(None, None)
    if len(text) > MAX_SCAN_CHARS:
        text = text[-MAX_SCAN_CHARS:]
    part = _final_part(_clean(text))
    if part is None:
        return Extraction(None, None)
    return _extract(_MARKDOWN.sub("", part))


def extract_answer(text: str | None) -> tuple[str | None, str | None]:
    """(answer, rule) for a model output, or (None, None) when it holds no answer."""
    e = extract_final(text)
    return e.answer, e.rule


def _final_statement(text: str):
    """The last explicit final-answer statement: "final answer is ...", "the answer is ...", or
    a "Final Answer" heading followed by the answer; as (match end, answer) or None."""
    best = None
    for pat in (_FINAL_IS, _FINAL_HEADING):
        m = _last(pat, text)
        if m is not None and (best is None or m.end() > best.end()):
            best = m
    if best is None:
        return None
    ans = _refine(text[best.end():best.end() + SEGMENT_MAX_CHARS])
    return (best.end(), ans) if ans else None


def _extract(text: str) -> Extraction:
    if not text.strip():
        return Extraction(None, None)
    boxes = find_boxes(text)
    if boxes:
        group = _group(boxes, text)
        after = text[group[-1][1]:]
        final = _final_statement(after)
        if final is not None:
            return Extraction(final[1], "final_answer")
        ans = _part_answer(boxes, text) or _join([c for _, _, c in group])
        if ans:
            stated = _restatement(_tail(after)[1]) if _single_number(ans) else None
            others = (stated,) if stated else ()
            return Extraction(ans, "boxed", tuple(o for o in others if o != ans))

    final = _final_statement(text)
    if final is not None:
        return Extraction(final[1], "final_answer")

    m = _last(_ANSWER_COLON, text) or _ANSWER_START.match(text)
    if m is not None and m.end() < len(text):
        ans = _refine(text[m.end():m.end() + SEGMENT_MAX_CHARS])
        if ans:
            return Extraction(ans, "answer")

    spans = [s for s in math_spans(text) if s[2].strip()]
    off, tail = _tail(text)
    stated = _statement(tail) or _conclusion(tail)
    if stated is not None:
        stated = (off + stated[0], stated[1])
    if stated is not None and (not spans or (stated[0] > spans[-1][1] and _numeric(stated[1]))):
        return Extraction(stated[1], "is")  # the last sentence states it in words
    if spans:
        group = _group(spans, text)
        rest = text[group[-1][1]:]
        if _runs_on(rest):
            return Extraction(None, None)  # "we get $x = 5$ and then": cut off, not concluded
        ans = _join([c for _, _, c in group])
        if ans:
            return Extraction(ans, "math")

    bare = text.strip()
    words = _number_words(bare)
    if words is not None and re.fullmatch(r"\s*(?:percent|per cent|degrees?)?[\s.]*",
                                          bare[words[1]:], re.I):
        return Extraction(_prose_value(bare), "bare")  # "twenty-five percent"
    if len(bare) <= BARE_MAX_CHARS and "\n\n" not in bare and not _is_prose(bare):
        bare = bare.replace("$", " ").strip().rstrip(".").strip()
        if bare:
            return Extraction(bare, "bare")
    return Extraction(None, None)


def _is_prose(text: str) -> bool:
    """A sentence rather than an answer ("I ran out of tokens while"): five or more plain words.
    Words inside \\text{} are an answer's own words and do not count."""
    outside = _TEXT_CMD.sub(" ", text)
    words = [t for t in outside.split() if _WORD.fullmatch(t)]
    return len(words) >= PROSE_WORDS
