"""Answers stated in prose: numbers and number words after "is", concluding sentences, restated values.

Pure string work on the last `SEGMENT_MAX_CHARS` of an output; every regex is free of nested
quantifiers. `docs/grading.md` lists the rules and their guards.
"""

from __future__ import annotations

import re

from protocol.grading.spans import last_match, mask_math

_SENTENCE_END = re.compile(r"(?<![0-9])\.(?![0-9])|\n")
#: How far after "Answer:" / "final answer is" the answer is looked for.
SEGMENT_MAX_CHARS = 2000

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
            r"|-?\d+(?:[. ]\d{3})*,\d+(?![\d,])"                # 3,5 / 1.234,56 (decimal comma)
            r"|-?\d+\s+\d+\s*/\s*\d+"                         # 2 1/2 (a mixed number)
            r"|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
LEAD_NUMBER = re.compile(rf"\s*(?P<num>{_CLOCK}|{_NUMERAL})"
                          r"(?P<unit>\s*(?:%|\\%|per\s?cent\b|percentage(?:\s+points?)?\b|pct\b|degrees?\b|°))?")
#: "is" and its kin ("we get", "gives"); also the copulas and "we get" verbs of French, German,
#: Spanish, Russian and Arabic ("Le prix est 12,75 €", "Die Summe beträgt 45", "On obtient 12",
#: "Получаем 45"), whose "answer is" phrases `multilingual` rewrites. Not "son" (Spanish "are",
#: an English noun).
IS_WORD = re.compile(r"(?i)\b(?:is|are|was|were|equals|be|get|gives|est|sont|vaut|obtient|obtenons|"
                     r"trouve|trouvons|ist|sind|beträgt|betragen|ergibt|erhalten|erhält|es|vale|"
                     r"obtenemos|obtiene|равен|равна|равно|равны|составляет|получаем|получим|"
                     r"получается|هو|هي|يساوي)\s+|\bat\s+(?=\d{1,2}:\d{2})")


def number_words(s: str) -> tuple[str, int] | None:
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


#: Words that may stand before a stated value: "is a 25% increase", "is about 3.5 hours", and
#: French/Spanish "de" ("est donc de 45 €", read "est Therefore, de 45 €" after `multilingual`).
_HEDGES = (r"a|an|the|about|approximately|roughly|around|exactly|only|just|precisely|equal to|"
           r"therefore,?|thus,?|hence,?|then,?|also,?|gleich|égale? à|igual a|de")
#: A hedge before a number, or before a second hedge and a number ("therefore, de 45").
_HEDGE_LEAD = re.compile(rf"(?i)^\s*(?:{_HEDGES})\s+(?=[-\d.]|(?:{_HEDGES})\s+[-\d.])")


def strip_lead(rest: str) -> str:
    """`rest` without up to two leading hedges or connectives ("about", "therefore", "also")."""
    return _HEDGE_LEAD.sub("", _HEDGE_LEAD.sub("", rest, count=1), count=1)


def prose_value(rest: str) -> str | None:
    """The answer at the start of prose that follows "is"/"are": a number keeps only what makes
    it a value (percent, degrees, a.m./p.m.), dropping the nouns after it ("12 such numbers" ->
    "12", "2 1/2 cups" -> "2 1/2", "twenty-five percent" -> "25%"); other text is kept when it is
    short (four words at most: "Evelyn", "the ellipse"), else there is no answer here."""
    rest = strip_lead(rest)
    m = LEAD_NUMBER.match(rest)
    if m is not None:
        after = rest[m.end():]
        sentence = _SENTENCE_END.split(after, maxsplit=1)[0]
        if not re.search(r"\d", sentence):  # "3 and 4" is a list, not the number 3
            unit = m.group("unit") or ""
            return m.group("num").strip() + ("\\%" if re.search("%|cent|pct", unit) else
                                            "^\\circ" if unit.strip() else "")
    words = number_words(rest)
    if words is not None:
        digits, used = words
        unit = re.match(r"\s*(percent|per cent|degrees?)\b", rest[used:], re.I)
        return digits + ("" if unit is None else "^\\circ" if unit.group(1).startswith("deg")
                         else "\\%")
    seg = _SENTENCE_END.split(rest[:200], maxsplit=1)[0].strip().rstrip(".,;:")
    if m is not None or (seg and len(seg.split()) <= 4) or looks_like_math(seg):
        return seg or None
    return None


_MATH_WORDS = frozenset("sin cos tan cot sec csc log ln exp lim max min".split())


def looks_like_math(seg: str) -> bool:
    """A long expression written without delimiters ("x^2 + 2x + 1 - \\frac{1}{x}"): operators
    or LaTeX commands, and no word of two or more letters but function names. Prose ("the number
    of ways to choose 3") has words and is not taken whole."""
    if not re.search(r"[+\-*/^=]|\\[A-Za-z]", seg):
        return False
    words = re.findall(r"[A-Za-z]{2,}", re.sub(r"\\[A-Za-z]+", " ", seg))
    return all(w.lower() in _MATH_WORDS for w in words)


#: The end of a complete sentence: a period that is not a decimal point, "!", "?", a line end.
_SENTENCE_STOP = re.compile(r"\.(?!\d)|[!?]|\n")


def runs_on(rest: str) -> bool:
    """Whether the text after a value ends in a sentence that never ends: two or more words after
    the last period, "!", "?" or line end ("4 times the", "$x = 5$. So for n = 4 we"). That is
    an output cut off mid-sentence, whose last value is not its answer; a unit or currency sign
    alone after the value ("1,000.99€", "$28$ %", "5 cm") still ends it."""
    last = None
    for last in _SENTENCE_STOP.finditer(no_meridiem_dots(rest)):
        pass
    fragment = rest if last is None else rest[last.end():]
    return len(re.findall(r"[A-Za-z]+", fragment)) >= 2


def no_meridiem_dots(s: str) -> str:
    return re.sub(r"([ap])\.m\.", r"\1m.", s)  # "p.m." may also end the sentence


_SPELLED = re.compile(r"(?i)\b(?:" + "|".join(w for w in _NUMBER_WORDS if w not in ("zero", "one")) + r")\b")


def states_more(rest: str) -> bool:
    """Whether text after a sentence could state a value (a digit, math, a box, an English number
    from two up: "So we need to consider two cases."): closing remarks without one ("I hope this
    helps!") do not displace the concluding sentence."""
    return bool(re.search(r"[0-9$\\]", rest) or _SPELLED.search(rest))


#: Words that address the reader: a closing remark ("Feel free to ask if anything is unclear.",
#: "Let me know if you have any other questions!", "Have a great day!"), never a statement.
_PLEASANTRY = re.compile(r"(?i)\b(?:you|your|hope|feel free|let me know|questions?|thanks|thank|glad|"
                         r"happy to|good luck|enjoy|cheers|have a (?:great|nice|good))\b")
_LAST_SENTENCE = re.compile(r"[^.!?\n]*[.!?]+[\s\W]*$")


def drop_closing(text: str) -> str:
    """`text` without its closing remarks: up to three complete last sentences with no digit and
    no math that address the reader. Their "is" ("if anything is unclear") is not the answer's;
    an unfinished fragment is not dropped (it may be a cut-off answer)."""
    for _ in range(3):
        m = _LAST_SENTENCE.search(text[-400:])
        if m is None or (m.start() == 0 and len(text) > 400):
            return text  # no complete last sentence (or one too long to be a remark)
        sentence = m.group(0)
        if (states_more(sentence) or not _PLEASANTRY.search(sentence)
                or not text[:len(text) - len(sentence)].strip()):
            return text
        text = text[:len(text) - len(sentence)]
    return text


def numeric(value: str) -> bool:
    return bool(LEAD_NUMBER.match(value))


def _subject_and_number(value: str) -> bool:
    """A value of words and a number ("die Summe 45" after "beträgt": verb-second word order):
    neither a number nor a text answer. LaTeX commands are not words (`\\frac{1}{2}`)."""
    words = re.sub(r"\\[A-Za-z]+", " ", value)
    return not numeric(value) and bool(re.search(r"\d", words) and re.search(r"[^\W\d_]{2,}", words))


def statement(text: str) -> tuple[int, str] | None:
    """(position, value) of the value stated by the last "is"/"are"/"equals"/"gives" outside
    math, when it is in the last sentence of `text` ("Therefore, there are 12 such numbers.")."""
    masked = mask_math(text)
    m = last_match(IS_WORD, masked)
    if m is None:
        return None
    value = prose_value(text[m.end():m.end() + 200])
    if value is not None and not numeric(value):
        value = _percent_subject(text, masked, m.start()) or value
    if value is None or _subject_and_number(value):
        return None  # words and a number ("beträgt die Summe 45"): a subject, not a text answer
    tail = text[m.end():]
    lead = LEAD_NUMBER.match(strip_lead(tail))
    if runs_on(tail if lead is None else strip_lead(tail)[lead.end():]):
        return None  # cut off mid-sentence ("the number of ways is 4 times the"): no statement
    end = _SENTENCE_END.search(no_meridiem_dots(tail))
    if end is not None and states_more(tail[end.end():]):
        return None  # a later sentence names a value: this is not the concluding statement
    return m.start(), value


def _percent_subject(text: str, masked: str, pos: int) -> str | None:
    """The percentage a sentence's subject names when its "is"/"are" states words ("Therefore,
    28 percent of the apples are red." answers 28%, not "red"): exactly one number before `pos`
    in the sentence, and it is a percentage."""
    start = max((e.end() for e in _SENTENCE_END.finditer(masked, 0, pos)), default=0)
    numbers = list(_ANY_NUMBER.finditer(masked, start, pos))
    if len(numbers) != 1:
        return None
    value = prose_value(text[numbers[0].start():pos])
    return value if value and value.endswith("\\%") else None


#: A conclusion word at a sentence start, or after a comma or semicolon ("..., so it covers 120
#: miles."): the clause it opens states the result.
_CONCLUSION = re.compile(r"(?i)(?:^|(?<=[.!?\n,;]))\s*(?:so|thus|therefore|hence|consequently|in total|"
                         r"in all|altogether|overall|finally|in the end|in conclusion|as a result|"
                         r"ultimately|all in all)\b[ ,]*")
#: Not `\b`: after `multilingual`, "小明Therefore, 有 15 个" has no boundary before the word.
_MID_CONCLUSION = re.compile(r"(?i)(?<![A-Za-z])(?:therefore|thus|hence)\b")
_ANY_NUMBER = re.compile(rf"(?<![\w.])(?:{_CLOCK}|{_NUMERAL})")
_WORD_START = re.compile(r"(?<![A-Za-z-])[A-Za-z]+")


#: Words after which a spelled number states a result ("increased by twenty-five percent", "has
#: seventeen"); elsewhere a small number word is working ("we need to consider two cases").
_RESULT_BEFORE = re.compile(r"(?i)\b(?:is|are|was|were|has|have|had|by|equals|needs|costs|totals|makes|"
                            r"holds|contains|gets|got|of|remain|remains|left)\s+$")


def _spelled_number(sentence: str) -> int | None:
    """Where the one English number of a sentence without digits starts ("Thus the price
    increased by twenty-five percent."), or None when it has none, several, or one that does not
    state a result: it must be a percentage or a fraction, or follow a result word ("has", "by",
    "is", ...): "So we need to consider two cases." states nothing, and a bare "one" is a pronoun
    ("each one weighs")."""
    found, used_to = [], 0
    for m in _WORD_START.finditer(sentence):
        if m.start() < used_to or m.group(0).lower() not in _NUMBER_WORDS:
            continue
        words = number_words(sentence[m.start():])
        if words is None:
            continue
        used_to = m.start() + words[1]
        percent = re.match(r"\s*(?:percent|per cent)\b", sentence[used_to:], re.I)
        if words[0] == "1" and not percent:
            continue
        if percent or "/" in words[0] or _RESULT_BEFORE.search(sentence[:m.start()]):
            found.append(m.start())
        else:
            found.append(-1)  # a number that states no result: the sentence is working
    return found[0] if len(found) == 1 and found[0] >= 0 else None


def conclusion(text: str) -> tuple[int, str] | None:
    """(position, value) when the last sentence is a conclusion ("So", "Thus", "Therefore",
    "In total", ..., also after a comma: "..., so it covers 120 miles.") that names exactly one
    number outside math: "So the recipe needs 2 1/2 cups.", "Thus it rose by twenty-five
    percent." A concluding clause with one number states the result whatever its verb; with two
    numbers, or without a conclusion word, it is not taken (it may be working)."""
    masked = mask_math(text)
    matches = list(_CONCLUSION.finditer(masked))
    for m in reversed(matches[-3:]):  # ", in total." may close the sentence that "So" opened
        stated = _concluded(text, masked, m.start(), m.end())
        if stated is not None:
            return stated
    # "She therefore has 15 apples.", "Marie a donc 15 pommes." (donc -> therefore): a
    # conclusion word inside the last sentence makes the whole sentence the concluding clause
    body = masked.rstrip()
    start = max((e.end() for e in _SENTENCE_END.finditer(body[:-1])), default=0)
    if _MID_CONCLUSION.search(body, start):
        return _concluded(text, masked, start, start)
    return None


def _concluded(text: str, masked: str, at: int, end: int) -> tuple[int, str] | None:
    """The value of the clause that starts at `end` (its conclusion word at `at`)."""
    sentence = masked[end:]
    stop = _SENTENCE_END.search(no_meridiem_dots(sentence))
    if stop is not None and states_more(sentence[stop.end():]):
        return None  # a later sentence names a value
    if not _SENTENCE_STOP.search(no_meridiem_dots(sentence)):
        return None  # cut off before the sentence ends
    numbers = list(_ANY_NUMBER.finditer(sentence))
    if len(numbers) == 1:
        start = numbers[0].start()
    elif not numbers and (spelled := _spelled_number(sentence)) is not None:
        start = spelled
    else:
        return None  # two numbers: working
    value = prose_value(text[end + start:end + start + 200])
    return (at, value) if value and numeric(value) else None


_RESTATE = re.compile(r"(?i)\s*(?:so|thus|therefore|hence|consequently|in total|in all|altogether|"
                      r"overall|finally|actually|wait|but|correction)\b|.*\banswer\b")


def single_number(ans: str) -> bool:
    """A boxed answer that is one number (`12`, `\\frac{3}{4}`, `2\\sqrt{3}`), the only kind a
    number restated after it can contradict: after `\\boxed{(1,2),(3,4)}`, "So there are 2
    pairs" counts the answer instead of restating it."""
    return bool(re.search(r"\d", ans)) and not re.search(
        r"[,;=(\[]|\\[{}]|matrix|\\cup|\\pm|[a-zA-Z]\s*$", ans)


def tail_window(text: str) -> tuple[int, str]:
    """(offset, text) of the end of `text` in which a concluding sentence is looked for: the last
    `SEGMENT_MAX_CHARS`, from a line start so that no math span is cut in two. Keeps the prose
    rules linear in a short window whatever the output's length."""
    if len(text) <= SEGMENT_MAX_CHARS:
        return 0, text
    off = len(text) - SEGMENT_MAX_CHARS
    nl = text.find("\n", off)
    off = nl + 1 if 0 <= nl < len(text) - 1 else off
    return off, text[off:]


def restatement(after: str) -> str | None:
    """A number restated in the concluding sentence after the last box ("\\boxed{12}. Thus there
    are 13 such numbers.", "... Actually, it should be 4."). The output then states two final
    answers, and credit needs both right. Only a sentence that concludes or corrects counts
    ("so", "thus", "actually", "wait", "the answer ..."): "The other root is 3, which we reject"
    is commentary."""
    masked = mask_math(after)
    starts = [0] + [m.end() for m in _SENTENCE_END.finditer(re.sub(r"[ap]\.m\.", "pm", masked))
                    if states_more(after[m.end():])]
    sentence = after[starts[-1]:]
    if not _RESTATE.match(mask_math(sentence)):
        return None
    stated = statement(sentence) or conclusion(sentence)
    return stated[1] if stated and numeric(stated[1]) else None

