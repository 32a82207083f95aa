"""Final-answer statements in other languages and numerals of other scripts, in the English forms
the extraction rules read.

Reasoning models switch language mid-answer, and multilingual math sets exist, so an output may end
"所以答案是 12。", "La réponse finale est 3,5.", "Ответ: 16" or "الجواب هو ١٢". `to_common(text)`
rewrites, with one linear pass per step and no nested quantifiers:

* **numerals**: Arabic-Indic (٠-٩), Eastern Arabic-Indic (۰-۹), Devanagari (०-९) and full-width
  (０-９) digits become ASCII digits; the Arabic decimal separator ٫ becomes ".", the Arabic
  thousands separator ٬ ",";
* **punctuation**: CJK and full-width sentence marks ("。", "，", "：", "！", "？"), the Devanagari
  danda "।" and the Arabic comma/question mark become their ASCII forms followed by a space (so
  "3。" ends a sentence as "3. " does), and a space is put between a CJK character and an ASCII
  digit, letter or math delimiter (so `\\b` and the number rules see the number);
* **phrases**: the "final answer is", "the answer is", "Answer:" and "therefore" families of
  Chinese, Japanese, French, German, Spanish, Russian, Arabic and Hindi become "the final answer
  is ", "the answer is ", "Answer: " and "Therefore, "; each is matched as a whole phrase (word
  boundaries in Latin and Cyrillic scripts), so ordinary words are never rewritten;
* **Chinese numerals** (一 ... 九, 十, 百, 千, 万, 两, 零) directly after an answer phrase become digits
  ("答案是十二" → "the answer is 12"); "百分之二十五" is 25%. Elsewhere they stay as they are
  ("一共" is "altogether", not 1);
* **percent words** of those languages after a number ("25 Prozent", "25 pour cent",
  "25 процентов", "25 प्रतिशत") become "percent".

Text in English (or any text without these characters and phrases) comes back unchanged, so no
English rule changes meaning. Limits (docs/grading.md): word orders the phrase lists do not cover
("उत्तर 8 है" is read, "8 ही उत्तर है" is not), Chinese numerals only after an answer phrase, and only
the scripts above.
"""

from __future__ import annotations

import re

__all__ = ["to_common", "DIGITS", "cn_number", "PHRASE_WINDOW"]

#: Phrases are rewritten in the last this many characters only (a final statement sits at the end);
#: keeps the pass to milliseconds on hostile multi-hundred-kilobyte outputs.
PHRASE_WINDOW = 16_000

#: Other scripts' digits and separators -> ASCII (also used on golds by `normalize.canonical`).
DIGITS = {}
for _zero in (0x0660, 0x06F0, 0x0966, 0xFF10):
    DIGITS.update({_zero + k: str(k) for k in range(10)})
DIGITS.update({0x066B: ".", 0x066C: ","})

_FULLWIDTH = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F) if not 0xFF10 <= c <= 0xFF19}
_MARKS = {"。": ". ", "，": ", ", "、": ", ", "：": ": ", "；": "; ", "！": "! ", "？": "? ",
          "．": ". ", "।": ". ", "॥": ". ", "،": ", ", "؟": "? ", "؛": "; ", "\u3000": " ",
          "（": " (", "）": ") "}
_MARKS_RE = re.compile("|".join(map(re.escape, _MARKS)))
_CJK = r"\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af"
_CJK_GAP = re.compile(rf"(?<=[{_CJK}])(?=[0-9A-Za-z$\\(-])|(?<=[0-9A-Za-z$)])(?=[{_CJK}])")

# The phrase families. Longer phrases first inside each alternation (regex alternation is ordered).
_FINAL = [
    r"最终答案(?:是|为|為)?", r"最後の答え(?:は)?", r"最終的な答え(?:は)?", r"最终结果(?:是|为)?",
    r"(?i:la\s+réponse\s+finale\s+(?:est|sera))", r"(?i:réponse\s+finale)",
    r"(?i:die\s+endgültige\s+antwort\s+(?:ist|lautet))", r"(?i:endgültige\s+antwort)",
    r"(?i:das\s+endergebnis\s+(?:ist|lautet))", r"(?i:endergebnis)",
    r"(?i:la\s+respuesta\s+final\s+(?:es|será))", r"(?i:respuesta\s+final)",
    r"(?i:окончательный\s+ответ(?:\s+(?:равен|будет))?)",
    r"الإجابة\s+النهائية(?:\s+هي)?", r"الجواب\s+النهائي(?:\s+هو)?",
    r"अंतिम\s+उत्तर(?:\s+है)?",
]
_IS = [
    r"答案(?:是|为|為)", r"答え(?:は)", r"解答(?:は)",
    r"(?i:la\s+(?:bonne\s+)?réponse\s+(?:est|sera))", r"(?i:la\s+solution\s+est)",
    r"(?i:die\s+(?:richtige\s+)?antwort\s+(?:ist|lautet))", r"(?i:die\s+lösung\s+(?:ist|lautet))",
    r"(?i:la\s+respuesta\s+(?:correcta\s+)?(?:es|será))", r"(?i:la\s+solución\s+es)",
    r"(?i:ответ\s+(?:равен|будет|—|-))",
    r"الجواب\s+هو", r"الإجابة\s+هي", r"الحل\s+هو", r"الجواب\s+يساوي",
    r"उत्तर\s+(?:है|=)", r"उत्तर(?=\s*[-0-9$\\])",
]
_COLON = [
    r"答案\s*(?=:)", r"答え\s*(?=:)", r"解答\s*(?=:)", r"答\s*(?=:)", r"(?i:réponse\s*(?=:))", r"(?i:antwort\s*(?=:))",
    r"(?i:lösung\s*(?=:))", r"(?i:respuesta\s*(?=:))", r"(?i:ответ\s*(?=:))", r"الإجابة\s*(?=:)",
    r"الجواب\s*(?=:)", r"उत्तर\s*(?=:)",
]
_THEREFORE = [
    r"综上所述", r"综上", r"所以", r"因此", r"于是", r"从而", r"一共", r"总共", r"共计", r"总计", r"合计",
    r"最后", r"最终", r"したがって", r"従って", r"よって", r"ゆえに",
    r"以上より", r"(?i:par\s+conséquent)", r"(?i:donc)", r"(?i:ainsi)", r"(?i:au\s+total)",
    r"(?i:finalement)", r"(?i:en\s+conclusion)", r"(?i:au\s+final)", r"(?i:en\s+définitive)",
    r"(?i:daher)", r"(?i:somit)", r"(?i:folglich)", r"(?i:deshalb)", r"(?i:demnach)", r"(?i:insgesamt)",
    r"(?i:por\s+lo\s+tanto)", r"(?i:por\s+tanto)", r"(?i:por\s+consiguiente)", r"(?i:así\s+que)",
    r"(?i:en\s+total)", r"(?i:таким\s+образом)", r"(?i:следовательно)", r"(?i:поэтому)", r"(?i:итак)",
    r"(?i:значит)", r"وبالتالي", r"لذلك", r"إذن", r"اذن", r"لذا", r"अतः", r"अत:", r"इसलिए",
    r"इस\s+प्रकार", r"अंततः", r"कुल\s+मिलाकर", r"कुल",
]
_COMMON = {"final": "the final answer is ", "is": "the answer is ", "colon": "Answer",
           "therefore": "Therefore, "}
_CJK_CHAR = re.compile(rf"[{_CJK}]")


def _bounded(p: str) -> str:
    """Phrases of scripts that separate words by spaces match whole words only ("donc" inside
    another word is not "donc"); Chinese and Japanese have no spaces between words."""
    return f"(?:{p})" if _CJK_CHAR.match(p) else f"(?<![^\\W\\d_])(?:{p})(?![^\\W\\d_])"


def _first_chars(pats: list[str]) -> str:
    """The characters a phrase can start with (both cases), for a one-character look-ahead that
    lets the scan skip every other position at once: the pass stays fast on long outputs."""
    chars = set()
    for p in pats:
        c = p[4] if p.startswith("(?i:") else p[0]
        chars.update((c.lower(), c.upper()))
    return "".join(sorted(chars))


_ALL = (("final", _FINAL), ("is", _IS), ("colon", _COLON), ("therefore", _THEREFORE))
_PHRASES = re.compile(f"(?=[{_first_chars([p for _, pats in _ALL for p in pats])}])(?:" + "|".join(
    f"(?P<{name}>{'|'.join(_bounded(p) for p in pats)})" for name, pats in _ALL) + ")")

_CN_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "兩": 2, "三": 3, "四": 4, "五": 5, "六": 6,
              "七": 7, "八": 8, "九": 9}
_CN_UNITS = {"十": 10, "百": 100, "千": 1000}
_CN_RUN = re.compile(r"[\s:]*(百分之)?([零〇一二两兩三四五六七八九十百千万萬]{1,12})")
_PERCENT_WORDS = re.compile(r"(?<=[0-9])\s*(?:(?i:prozent|pour\s*cent|por\s*ciento|процент\w{0,3})|"
                            r"بالمئة|بالمائة|في\s+المائة|प्रतिशत|パーセント)")


def cn_number(s: str) -> int | None:
    """The value of a simple Chinese numeral ("十二" 12, "二十" 20, "一百零五" 105, "两千" 2000,
    "三万五千" 35000), or None when `s` is not one."""
    total, section, digit, seen = 0, 0, None, False
    for ch in s:
        if ch in _CN_DIGITS:
            if digit is not None:
                return None  # two digits in a row ("一二") is not a simple numeral
            digit = _CN_DIGITS[ch]
        elif ch in _CN_UNITS:
            section += (1 if digit is None else digit) * _CN_UNITS[ch]
            digit = None
        elif ch in "万萬":
            section += digit or 0
            if section == 0 or total:
                return None
            total, section, digit = section * 10_000, 0, None
        else:
            return None
        seen = True
        if digit == 0:
            digit = None  # "一百零五": the zero only marks a gap
    return total + section + (digit or 0) if seen else None


def _numerals_after(text: str, pos: int) -> tuple[str, int] | None:
    """A Chinese numeral right after an answer phrase, as (digits, end)."""
    m = _CN_RUN.match(text, pos)
    if m is None:
        return None
    value = cn_number(m.group(2))
    if value is None:
        return None
    return str(value) + ("\\%" if m.group(1) else ""), m.end()


def to_common(text: str) -> str:
    """`text` with other scripts' numerals, sentence marks and final-answer phrases in the forms
    the English rules read (see the module docstring); text in English comes back unchanged."""
    if not text.isascii():
        text = _MARKS_RE.sub(lambda m: _MARKS[m.group(0)], text.translate(DIGITS))
        text = text.translate(_FULLWIDTH)
        text = _CJK_GAP.sub(" ", text)
    text = _PERCENT_WORDS.sub(" percent", text)
    last = max(0, len(text) - PHRASE_WINDOW)
    out = [text[:last]]
    for m in _PHRASES.finditer(text, last):
        out.append(text[last:m.start()])
        out.append(_COMMON[m.lastgroup])
        last = m.end()
        if m.lastgroup != "therefore":
            cn = _numerals_after(text, last)
            if cn is not None:
                out.append(cn[0])
                last = cn[1]
    out.append(text[last:])
    return "".join(out)
