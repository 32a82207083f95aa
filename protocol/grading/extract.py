"""Answer extraction from model output: pure string work, linear in the length of the text.

First the text that can hold the final answer is cut out (`_clean`, `_final_part`): the model's
own turn (up to a chat-template marker that follows content), the part after ``</think>`` (an
unclosed ``<think>`` is a trace cut off before its answer), with other languages' final-answer
phrases and numerals in English form (`multilingual.to_common`), without markdown
bold/headings. Boxes and math spans are found by `spans`, values in prose read by `prose`.
Then rules, tried in this order; the name of the one that fired is returned with the answer:

``boxed``
    The last *group* of complete ``\\boxed{...}`` / ``\\fbox{...}`` (brace matching, nested
    braces, ``\\boxed 5``). Boxes in one clause (nothing, punctuation, ``\\quad``, "and", "or",
    a hedge such as "or maybe" or "Alternatively,") are one answer joined with ", ", so
    ``\\boxed{898} \\boxed{900}`` gives ``898, 900``, never ``898900``. Boxes that answer
    labelled parts ((a), (b), ...) form one ordered tuple, boxes naming different unknowns
    (``a = \\boxed{3}``, ``b = \\boxed{4}``) the ordered list ``a = 3, b = 4``. A "final answer is ..." statement
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
math rules. An output that ended at the token limit (``truncated``: the record's `finish_reason`
is "length") has a final answer only where it marks one explicitly (the ``boxed``,
``final_answer`` and ``answer`` rules): the fallbacks would take an intermediate line of a
looping or unfinished solution as its answer. Everything is linear: one pass computes all brace matches, math spans are found with
forward `str.find` calls only, the prose rules read only the last `SEGMENT_MAX_CHARS`, and every
regex is free of nested quantifiers. docs/grading.md lists every rule with the reason for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.grading.multilingual import to_common
from protocol.grading.prose import (IS_WORD, LEAD_NUMBER, SEGMENT_MAX_CHARS, conclusion, drop_closing,
                                    number_words, numeric, prose_value,
                                    restatement, runs_on, single_number, statement, strip_lead, tail_window)
from protocol.grading.spans import (box_answer, find_boxes, group_runs, is_connector, join, last_match,
                                    mask_math, math_spans)

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
_FINAL_IS = re.compile(r"(?i)\b(?:final\s+answer|the\s+answer)\s+(?:is|was|would\s+be|will\s+be)\b\s*:?")
_ANSWER_COLON = re.compile(r"(?i)\banswer\s*\**\s*[:：]")
_ANSWER_START = re.compile(r"(?i)^\s*\**\s*answer\b\s*\**")
_HOPE = re.compile(r"(?i)\s*I\s+hope\s+it\s+is\s+correct.*$", re.S)
_SENTENCE_END = re.compile(r"(?<![0-9])\.(?![0-9])|\n")
_WORD = re.compile(r"[A-Za-z]{2,}[.,;:!?]?")
_TEXT_CMD = re.compile(r"\\(?:text|textnormal|mbox|textbf|textrm|mathrm|textit)\s*\{([^{}]*)\}")


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
                if not is_connector(seg[group[-1][1]:nxt[0]]):
                    break
                group.append(nxt)
            return join([c for _, _, c in group]) or None
    # "The largest $n$ is 34." -> the words after the last " is " carry the value
    outside = mask_math(seg)
    last_is = last_match(IS_WORD, outside)
    if last_is is not None:
        seg = seg[last_is.end():]
    spans = math_spans(seg)
    if spans:
        return join([c for _, _, c in group_runs(spans, seg)]) or None
    value = prose_value(seg)
    if value is not None and (LEAD_NUMBER.match(strip_lead(seg)) or number_words(seg)):
        return value
    seg = _SENTENCE_END.split(seg, maxsplit=1)[0]
    seg = seg.strip().rstrip(".,;:")
    return seg or None



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


def extract_final(text: str | None, truncated: bool = False) -> Extraction:
    """The final answer of a model output (see the module docstring for the rules); with
    `truncated` (the output ended at the token limit) only an explicitly marked final counts."""
    if not text or not isinstance(text, str):
        return Extraction(None, None)
    if len(text) > MAX_SCAN_CHARS:
        text = text[-MAX_SCAN_CHARS:]
    part = _final_part(_clean(text))
    if part is None:
        return Extraction(None, None)
    return _extract(_MARKDOWN.sub("", to_common(part)), truncated)


def extract_answer(text: str | None, truncated: bool = False) -> tuple[str | None, str | None]:
    """(answer, rule) for a model output, or (None, None) when it holds no answer."""
    e = extract_final(text, truncated)
    return e.answer, e.rule


def _final_statement(text: str):
    """The last explicit final-answer statement: "final answer is ...", "the answer is ...", or
    a "Final Answer" heading followed by the answer; as (match end, answer) or None."""
    best = None
    for pat in (_FINAL_IS, _FINAL_HEADING):
        m = last_match(pat, text)
        if m is not None and (best is None or m.end() > best.end()):
            best = m
    if best is None:
        return None
    ans = _refine(text[best.end():best.end() + SEGMENT_MAX_CHARS])
    return (best.end(), ans) if ans else None


def _extract(text: str, truncated: bool = False) -> Extraction:
    if not text.strip():
        return Extraction(None, None)
    boxes = find_boxes(text)
    if boxes:
        after = text[boxes[-1][1]:]
        final = _final_statement(after)
        if final is not None:
            return Extraction(final[1], "final_answer")
        ans = box_answer(boxes, text)
        if ans:
            stated = restatement(tail_window(after)[1]) if single_number(ans) else None
            others = (stated,) if stated else ()
            return Extraction(ans, "boxed", tuple(o for o in others if o != ans))

    final = _final_statement(text)
    if final is not None:
        return Extraction(final[1], "final_answer")

    m = last_match(_ANSWER_COLON, text) or _ANSWER_START.match(text)
    if m is not None and m.end() < len(text):
        ans = _refine(text[m.end():m.end() + SEGMENT_MAX_CHARS])
        if ans:
            return Extraction(ans, "answer")
    if truncated:
        return Extraction(None, None)  # cut off at the token limit: no marked final, no answer

    spans = [s for s in math_spans(text) if s[2].strip()]
    off, tail = tail_window(text)
    tail = drop_closing(tail)
    stated = statement(tail) or conclusion(tail)
    if stated is not None:
        stated = (off + stated[0], stated[1])
    if stated is not None and (not spans or (stated[0] > spans[-1][1] and numeric(stated[1]))):
        return Extraction(stated[1], "is")  # the last sentence states it in words
    if spans:
        group = group_runs(spans, text)
        rest = text[group[-1][1]:]
        if runs_on(rest):
            return Extraction(None, None)  # "we get $x = 5$ and then": cut off, not concluded
        ans = join([c for _, _, c in group])
        if ans:
            return Extraction(ans, "math")

    bare = text.strip()
    words = number_words(bare)
    if words is not None and re.fullmatch(r"\s*(?:percent|per cent|degrees?)?[\s.]*",
                                          bare[words[1]:], re.I):
        return Extraction(prose_value(bare), "bare")  # "twenty-five percent"
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
