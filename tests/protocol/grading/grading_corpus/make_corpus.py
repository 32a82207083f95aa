"""Write the labelled grading corpus `corpus.jsonl` by rule (run from the repository root):

    python tests/protocol/grading/grading_corpus/make_corpus.py [--data ../shared/data/math500.jsonl]

Every MATH-500 gold answer is classified into an answer type; for each, the script writes
model-style outputs that state either an answer *equal* to the gold (the gold itself, or an
unsimplified or differently spelled equal form) or a *near miss* (off by one, wrong sign,
swapped tuple, a different interval endpoint, another entry of a matrix, another text), wrapped
in the output styles of reasoning models: R1-distill (`<think>` ... `</think>` then the answer),
Qwen/Llama "final answer" lines, markdown "Final Answer" headings, display math, answers
restated in words, several boxes, chat-template leftovers after the answer, truncated traces.
A few families that MATH-500 golds do not cover (clock times, percentages in prose, mixed
numbers, thousands separators) are added from fixed golds, and `handwritten.jsonl` (pairs
written and labelled by hand, one reviewed label each) is appended as it is.

Each line: `pred`, `gold`, `expected`, `category` (the answer type), `style`, `variant`
(how the stated answer relates to the gold). The label follows from the construction:

* `expected` is true exactly when the output's final answer is an equal form of the gold;
* a trace cut off inside `<think>` has no final answer: false;
* an output that hedges between two different boxed answers, or restates a different number
  after its box, does not state one right answer: false.

Equal forms are only rewrites that keep the value by construction (a fraction with numerator
and denominator doubled, reordered set elements, `\\dfrac`, `\\left(`, a thousands separator,
`^\\circ` dropped), never anything computed by the grader under test.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[3] / "shared" / "data" / "math500.jsonl"
SEED = 20260601

# --------------------------------------------------------------------------------- answer types


def answer_type(a: str) -> str:
    """The MATH-500 answer type of a gold answer, by its spelling."""
    s = a.strip()
    if "matrix" in s:
        return "matrix"
    if re.search(r"\\text\{\s*\(?[A-Za-z]", s) and not re.search(r"\d", s):
        return "text"
    if re.search(r"\\(?:text|mbox)\{\s*(cents|degrees|inches|cm|units|square|feet|dollars|hours|minutes|"
                 r"meters|mph|pounds|days)", s) or s.startswith("\\$"):
        return "units"
    if "^\\circ" in s:
        return "degrees"
    if re.fullmatch(r"\d+_\{?\d+\}?", s):
        return "base"
    if re.search(r"\\cup|\\in|^[\[(].*,.*[\])]$", s) and re.search(r"[\[\]]|\\infty|\\cup", s):
        return "interval"
    if s.startswith("\\{"):
        return "set"
    if re.fullmatch(r"\\left\s*\(.*\\right\s*\)|\(.*\)", s) and "," in s:
        return "tuple"
    if "=" in s:
        return "equation"
    if re.search(r"(?<![a-z\\])i(?![a-z])", s) and re.search(r"\d", s) and "\\pi" not in s:
        return "complex"
    if "," in s and not re.fullmatch(r"-?\d{1,3}(,\\!\s*\d{3}|,\d{3})+", s):
        return "list"
    if re.fullmatch(r"-?\d+", s) or re.fullmatch(r"-?\d{1,3}(,\\!\s*\d{3}|,\d{3})+", s):
        return "integer"
    if re.fullmatch(r"-?\d*\.\d+", s):
        return "decimal"
    if re.fullmatch(r"-?\\[dt]?frac\{-?\d+\}\{\d+\}|-?\d+/\d+|\\frac\d\d", s):
        return "fraction"
    if "\\sqrt" in s or "\\pi" in s:
        return "radical_pi"
    if re.search(r"[a-z]", s):
        return "expression"
    return "other"


def _balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += {"{": 1, "(": 1, "[": 1, "}": -1, ")": -1, "]": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def _int(s: str) -> int:
    return int(re.sub(r"[,\\! ]", "", s))


def _with_sep(n: int, sep: str) -> str:
    return f"{n:,}".replace(",", sep)


# ---------------------------------------------------------------------------- equal forms

def equal_forms(a: str, kind: str) -> list[tuple[str, str]]:
    """(variant name, spelling) pairs that mean the same answer as `a`."""
    out = [("gold", a)]
    s = a.strip()
    if kind == "integer":
        n = _int(s)
        out.append(("unsimplified_fraction", f"\\frac{{{2 * n}}}{{2}}"))
        if abs(n) >= 1000:
            out += [("comma_sep", _with_sep(n, ",")), ("brace_comma_sep", _with_sep(n, "{,}")),
                    ("thin_space_sep", _with_sep(n, "\\,")), ("space_sep", _with_sep(n, " "))]
        else:
            out.append(("trailing_zero", f"{n}.0"))
    elif kind == "fraction":
        m = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", s)
        if m:
            sign, p, q = m.group(1), int(m.group(2)), int(m.group(3))
            out += [("dfrac", f"{sign}\\dfrac{{{p}}}{{{q}}}"), ("slash", f"{sign}{p}/{q}"),
                    ("doubled", f"{sign}\\frac{{{2 * p}}}{{{2 * q}}}")]
            if abs(p) < 10 and q < 10:
                out.append(("short_frac", f"{sign}\\frac{p}{q}"))
    elif kind == "decimal":
        if s.startswith("."):
            out.append(("leading_zero", "0" + s))
        elif s.startswith("0."):
            out.append(("no_leading_zero", s[1:]))
        out.append(("trailing_zero", s + "0"))
    elif kind in ("tuple", "interval"):
        inner = re.sub(r"\\left\s*|\\right\s*", "", s)
        out.append(("left_right", inner if inner != s or "\\cup" in s else
                    re.sub(r"^([\[(])(.*)([\])])$", r"\\left\1 \2 \\right\3", s)))
        out.append(("spaced", re.sub(r",\s*", ", ", inner)))
    elif kind == "set":
        m = re.fullmatch(r"\\\{(.*)\\\}", s)
        if m:
            items = [x.strip() for x in m.group(1).split(",")]
            if len(items) > 1 and "\\pm" not in s:
                out.append(("reordered", "\\{" + ", ".join(reversed(items)) + "\\}"))
    elif kind == "matrix":
        out.append(("bmatrix", s.replace("pmatrix", "bmatrix")))
    elif kind == "text":
        inner = re.sub(r"\\text\{(.*)\}", r"\1", s)
        out += [("plain", inner), ("textbf", f"\\textbf{{{inner}}}")]
        if re.fullmatch(r"[A-Za-z ]+", inner):
            out.append(("case", inner.upper() if inner != inner.upper() else inner.lower()))
    elif kind == "degrees":
        num = s.replace("^\\circ", "").strip()
        out += [("no_degree_sign", num), ("word_degrees", f"{num} degrees"),
                ("unicode_degree", f"{num}°"), ("braced_circ", f"{num}^{{\\circ}}")]
    elif kind == "base":
        m = re.fullmatch(r"(\d+)_\{?(\d+)\}?", s)
        out += [("braced_base", f"{m.group(1)}_{{{m.group(2)}}}"), ("no_base", m.group(1))]
    elif kind == "units":
        num = re.sub(r"\\text\{[^}]*\}|\\\$|\\!|,", "", s).strip()
        out += [("no_unit", num), ("textnormal_unit", s.replace("\\text{", "\\textnormal{"))]
    elif kind == "equation":
        lhs, _, rhs = s.partition("=")
        if s.count("=") == 1 and lhs.strip() and rhs.strip():
            out.append(("sides_swapped", f"{rhs.strip()} = {lhs.strip()}"))
    elif kind in ("radical_pi", "expression", "complex"):
        out.append(("dfrac", s.replace("\\frac", "\\dfrac")) if "\\frac" in s else
                   ("spaced", re.sub(r"\s*([+-])\s*", r" \1 ", s).strip()))
        terms = re.fullmatch(r"([^+\-]+)\+([^+\-]+)", s)
        if terms and all(_balanced(t) for t in terms.groups()):
            out.append(("terms_swapped", f"{terms.group(2).strip()} + {terms.group(1).strip()}"))
    seen, uniq = set(), []
    for name, form in out:
        if form not in seen:
            seen.add(form)
            uniq.append((name, form))
    return uniq


# --------------------------------------------------------------------------------- near misses

def _bump_first_number(s: str) -> str | None:
    m = re.search(r"(?<![\\a-zA-Z_^{])\d+", s)
    if m is None:
        return None
    return s[:m.start()] + str(int(m.group(0)) + 1) + s[m.end():]


def near_misses(a: str, kind: str, other_texts: list[str]) -> list[tuple[str, str]]:
    """(variant name, spelling) pairs that are a *different* answer from `a`."""
    s = a.strip()
    out: list[tuple[str, str]] = []
    if kind == "integer":
        n = _int(s)
        out.append(("off_by_one", str(n + 1)))
        if n != 0:
            out.append(("wrong_sign", str(-n)))
    elif kind == "fraction":
        m = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", s)
        if m:
            sign, p, q = m.group(1), int(m.group(2)), int(m.group(3))
            out.append(("numerator_plus_one", f"{sign}\\frac{{{p + 1}}}{{{q}}}"))
            out.append(("wrong_sign", f"{'' if sign else '-'}\\frac{{{p}}}{{{q}}}"))
            if abs(p) != q:
                out.append(("inverted", f"{sign}\\frac{{{q}}}{{{p}}}"))
    elif kind == "decimal":
        out.append(("last_digit", s[:-1] + str((int(s[-1]) + 1) % 10)))
    elif kind == "interval":
        flipped = None
        for i, c in enumerate(s):
            if c in "[(" and not s[i + 1:].lstrip().startswith("-\\infty"):
                flipped = s[:i] + ("(" if c == "[" else "[") + s[i + 1:]
                break
        if flipped:
            out.append(("endpoint_bracket", flipped))
        bumped = _bump_first_number(s)
        if bumped:
            out.append(("endpoint_value", bumped))
    elif kind == "tuple":
        inner = re.sub(r"\\left\s*|\\right\s*", "", s).strip()[1:-1]
        parts = [p.strip() for p in inner.split(",")]
        if not all(_balanced(p) for p in parts):
            return out
        if len(parts) >= 2 and parts[0] != parts[1]:
            out.append(("swapped", "(" + ", ".join([parts[1], parts[0]] + parts[2:]) + ")"))
        out.append(("first_plus_one", "(" + ", ".join([f"{parts[0]} + 1"] + parts[1:]) + ")"))
    elif kind in ("set", "list"):
        bumped = _bump_first_number(s)
        if bumped:
            out.append(("element_changed", bumped))
    elif kind == "matrix":
        bumped = _bump_first_number(s)
        if bumped:
            out.append(("entry_changed", bumped))
    elif kind == "text":
        others = [t for t in other_texts if t.lower() != s.lower()]
        out.append(("other_text", others[len(s) % len(others)]))
    elif kind == "degrees":
        num = s.replace("^\\circ", "").strip()
        bumped = _bump_first_number(num)
        if bumped:
            out.append(("other_angle", bumped + "^\\circ"))
    elif kind == "base":
        m = re.fullmatch(r"(\d+)_\{?(\d+)\}?", s)
        digits, base = m.group(1), int(m.group(2))
        last = int(digits[-1])
        new = last + 1 if last + 1 < base else last - 1
        out.append(("last_digit", f"{digits[:-1]}{new}_{{{base}}}"))
    elif kind == "units":
        bumped = _bump_first_number(s)
        if bumped:
            out.append(("value_changed", bumped))
    elif kind == "equation":
        lhs, _, rhs = s.partition("=")
        out.append(("rhs_plus_one", f"{lhs.strip()} = {rhs.strip()} + 1"))
    elif kind == "complex":
        flipped = re.sub(r"([+-])(\s*\d*\s*i)$", lambda m: ("-" if m.group(1) == "+" else "+") + m.group(2), s)
        if flipped != s:
            out.append(("conjugate", flipped))
        out.append(("plus_one", f"{s} + 1"))
    else:  # radical_pi, expression, other
        out.append(("plus_one", f"{s} + 1"))
        if not s.startswith("-"):
            out.append(("wrong_sign", f"-{s}" if re.fullmatch(r"[\\\w{}^]+", s) else f"-({s})"))
    return out


# ------------------------------------------------------------------------------------- styles

REASONING = [
    "Let me work through this carefully. First I restate what is asked, then I set up the "
    "relevant quantities and simplify step by step.",
    "We start from the given conditions. Substituting and simplifying gives a smaller problem, "
    "which we solve directly; a quick check confirms the computation.",
    "Consider the structure of the problem. After expanding and collecting terms, the value "
    "follows from a short computation.",
]
STOPS = [
    "<|im_end|>\n<|im_start|>user\nNow solve: what is $2+2$?<|im_end|>\n<|im_start|>assistant\n"
    "The answer is $\\boxed{4}$.",
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nThanks! And $3+4$?\n\n$\\boxed{7}$",
    "</s>",
    "\n\nHuman: Great. Can you also compute $10-3$?\n\nAssistant: Sure, $\\boxed{7}$.",
    "\n\nUser: What about $1+1$?\nAssistant: That is $\\boxed{2}$.",
    "<|endoftext|>Problem: compute $5+5$. Solution: $\\boxed{10}$",
]


def _plain(form: str) -> bool:
    """Can be written in prose without math delimiters (a number, a fraction with a slash)."""
    return bool(re.fullmatch(r"-?[\d.,/ ]+|[A-Za-z ]+", form))


def styles(rng: random.Random, form: str, other: str | None) -> list[tuple[str, str, bool]]:
    """(style, output text, states-this-answer-as-its-only-final-answer) for one answer form.
    `other` is a different answer used by the hedging and restating styles."""
    why = rng.choice(REASONING)
    out = [
        ("r1_think", f"<think>\n{why}\nHmm, let me double-check the arithmetic. Yes.\n</think>\n\n"
                     f"{why}\n\nTherefore, the answer is $\\boxed{{{form}}}$.", True),
        ("qwen_final", f"{why}\n\nThe final answer is $\\boxed{{{form}}}$.", True),
        ("llama_final", f"## Step 1: Understand\n{why}\n\n## Step 2: Compute\nSo we are done.\n\n"
                        f"The final answer is: $\\boxed{{{form}}}$", True),
        ("markdown_heading", f"{why}\n\n**Final Answer**\n\\[\n\\boxed{{{form}}}\n\\]", True),
        ("bold_final_answer", f"{why}\n\n**Final Answer:** ${form}$", True),
        ("display_math", f"{why} Hence\n$$\n{form}\n$$", True),
        ("chat_leftover", f"{why}\n\nSo the answer is $\\boxed{{{form}}}$." + rng.choice(STOPS), True),
        ("restated", f"{why} We get $\\boxed{{{form}}}$. So the answer is ${form}$.", True),
        ("answer_colon", f"{why}\n\nAnswer: ${form}$", True),
        ("corrected_box", f"{why} At first this gives $\\boxed{{{other or '0'}}}$. Wait, that "
                          f"drops a term. Redoing it: $\\boxed{{{form}}}$.", True),
        ("truncated_think", f"<think>\n{why}\nSo far the value looks like $\\boxed{{{form}}}$, but "
                            f"let me verify by another method. Expanding again we", False),
    ]
    if _plain(form):
        out += [
            ("bold_heading_plain", f"{why}\n\n**Final Answer**\n\n**{form}**", True),
            ("last_sentence", f"{why} Therefore, the answer is {form}.", True),
        ]
    if other is not None:
        out.append(("hedged_boxes", f"{why} The answer is $\\boxed{{{form}}}$ or possibly "
                                    f"$\\boxed{{{other}}}$.", False))
    return out


# ------------------------------------------------------------------------- families MATH lacks

EXTRA = [
    # category, gold, equal forms, different forms
    ("clock", "5:30", ["5:30", "5:30 \\text{ p.m.}", "5:30 AM"], ["6:30", "5:40", "5.30", "17:30"]),
    ("clock", "9:40\\text{ a.m.}", ["9:40", "9:40 am", "\\text{9:40 AM}"], ["9:40 \\text{ p.m.}", "9:04", "10:40"]),
    ("clock", "12:15", ["12:15", "12:15 p.m."], ["12:51", "1:15", "12:25"]),
    ("percent", "25\\%", ["25\\%", "25", "0.25", "\\frac{1}{4}"], ["26\\%", "2.5\\%", "0.025"]),
    ("percent", "12.5\\%", ["12.5\\%", "12.5", "\\frac{1}{8}"], ["12\\%", "125\\%"]),
    ("mixed_number", "\\frac{5}{2}", ["2\\frac{1}{2}", "2\\ \\frac12", "2 1/2", "2.5"], ["2\\frac{1}{3}", "3\\frac{1}{2}", "\\frac{2}{5}"]),
    ("mixed_number", "\\frac{31}{4}", ["7\\frac{3}{4}", "7 3/4", "7.75"], ["7\\frac{1}{4}", "\\frac{4}{31}"]),
    ("thousands_sep", "1234567", ["1,234,567", "1{,}234{,}567", "1\\,234\\,567", "1\\!234\\!567", "1 234 567"], ["1,234,576", "123,4567.1"]),
    ("thousands_sep", "10080", ["10,\\!080", "10{,}080", "10\\,080", "10 080"], ["10,\\!800", "1,008"]),
]

PROSE_EXTRA = [
    # category, output, gold, expected, style
    ("integer", "Counting each case once, there are 12 such numbers.", "12", True, "last_sentence_count"),
    ("integer", "Counting each case once, there are 13 such numbers.", "12", False, "last_sentence_count"),
    ("integer", "Adding the cases, we find that there are twenty-five such arrangements.", "25", True, "number_words"),
    ("integer", "Adding the cases, we find that there are twenty-four such arrangements.", "25", False, "number_words"),
    ("percent", "So the discount is twenty percent of the original price, i.e. the answer is 20%.", "20\\%", True, "percent_prose"),
    ("percent", "The probability of success is 35% in this setting.", "35", True, "percent_prose"),
    ("percent", "The probability of success is 53% in this setting.", "35", False, "percent_prose"),
    ("mixed_number", "She needs 2 1/2 cups of flour in total.", "\\frac52", False, "no_statement"),
    ("mixed_number", "So the recipe needs 2 1/2 cups.", "\\frac52", True, "mixed_prose"),
    ("clock", "Adding 2 hours and 45 minutes, the train arrives at 5:30 p.m.", "5:30", True, "clock_prose"),
    ("clock", "Adding 2 hours and 45 minutes, the train arrives at 5:45 p.m.", "5:30", False, "clock_prose"),
    ("integer", "We get $\\boxed{12}$. Thus there are 13 such numbers.", "12", False, "restated_different"),
    ("integer", "We get $\\boxed{12}$. Thus there are 12 such numbers.", "12", True, "restated_same"),
    ("tuple", "(a) The first value is $\\boxed{3}$.\n\n(b) The second is $\\boxed{4}$.", "3, 4", True, "multi_part"),
    ("tuple", "(a) The first value is $\\boxed{4}$.\n\n(b) The second is $\\boxed{3}$.", "3, 4", False, "multi_part"),
    ("tuple", "**Part (a):** $\\boxed{10}$\n\n**Part (b):** $\\boxed{\\frac{1}{2}}$", "10, \\frac12", True, "multi_part"),
    ("tuple", "**Part (a):** $\\boxed{10}$\n\n**Part (b):** $\\boxed{\\frac{1}{3}}$", "10, \\frac12", False, "multi_part"),
    ("units", "The area is $\\boxed{12\\textnormal{ cm}^2}$.", "12", True, "textnormal_unit"),
    ("units", "The length is $\\boxed{15\\mbox{ inches}}$.", "15", True, "mbox_unit"),
    ("units", "The length is $\\boxed{16\\mbox{ inches}}$.", "15", False, "mbox_unit"),
    ("integer", "<think>\nThe count is 7.\n</think>\n\n", "7", False, "think_no_answer"),
    ("integer", "<think>\nLet me guess $\\boxed{9}$ first.\n</think>\n\nThe count is $\\boxed{7}$.", "7", True, "think_then_answer"),
    ("integer", "<think>\nLet me guess $\\boxed{7}$ first.\n</think>\n\nThe count is $\\boxed{9}$.", "7", False, "think_then_answer"),
]


# ------------------------------------------------------------------------------------- corpus

def build(data: Path) -> list[dict]:
    rng = random.Random(SEED)
    golds = [json.loads(line)["answer"] for line in data.read_text(encoding="utf-8").splitlines()
             if line.strip()]
    texts = sorted({g for g in golds if answer_type(g) == "text"})
    rows: list[dict] = []
    for gold in golds:
        kind = answer_type(gold)
        eq = equal_forms(gold, kind)
        ne = near_misses(gold, kind, texts)
        miss = ne[0][1] if ne else None
        # one equal form and one near miss per gold, each in a style drawn by rule
        picks = [(eq[rng.randrange(len(eq))], True), (eq[rng.randrange(len(eq))], True)]
        if ne:
            picks.append((ne[rng.randrange(len(ne))], False))
        for (variant, form), equal in picks:
            options = styles(rng, form, miss if equal else gold)
            style, text, states = options[rng.randrange(len(options))]
            rows.append({"pred": text, "gold": gold, "expected": bool(equal and states),
                         "category": kind, "style": style, "variant": variant})
    for category, gold, same, different in EXTRA:
        for forms, equal in ((same, True), (different, False)):
            for form in forms:
                options = styles(rng, form, None)
                style, text, states = options[rng.randrange(len(options) - 1)]  # no truncation
                rows.append({"pred": text, "gold": gold, "expected": bool(equal and states),
                             "category": category, "style": style,
                             "variant": "equal_form" if equal else "different"})
    for category, text, gold, expected, style in PROSE_EXTRA:
        rows.append({"pred": text, "gold": gold, "expected": expected, "category": category,
                     "style": style, "variant": "prose"})
    # pairs written and labelled by hand (each reviewed), in the same record format
    hand = HERE / "handwritten.jsonl"
    rows += [json.loads(line) for line in hand.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=HERE / "corpus.jsonl")
    args = ap.parse_args()
    rows = build(args.data)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                        encoding="utf-8")
    print(f"wrote {len(rows)} pairs ({sum(r['expected'] for r in rows)} true) to {args.out}")


if __name__ == "__main__":
    main()
