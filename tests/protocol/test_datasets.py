"""Integrity of every shipped dataset's texts and answers, and the provenance of the AIME sets.

The texts are what a model is asked to solve, so they are checked as LaTeX: no control characters
(a `\\f` or `\\t` of `\\frac` / `\\triangle` read as an escape leaves one), every command known,
braces, math delimiters and environments balanced, no line break of an alignment lost. Each AIME set
has a provenance file beside it (`protocol/resources/<name>.provenance.json`) whose sha256 is the
data's and which cites, per problem, the answer keys the answer was checked against and every repair
of the text; reversing the repairs must give back exactly the copy shipped before them.
"""

from __future__ import annotations

import json
import re
import unicodedata

import pytest

from protocol import data as data_module
from protocol import prereg
from protocol.data import (AIME_REPLACED_SHA256, AIME_SHA256, DATASET_SHA256, DATASETS, aime_data_path, check_limit,
                           dataset_size, load_aime, load_dataset, provenance_path, sha256_hex)
from protocol.errors import ProtocolError
from protocol.grading.canonical import canonical
from protocol.grading.normalize import parse
from protocol.splits import manifest_sha256

# Commands of LaTeX, amsmath and amssymb that the shipped texts use. A command outside this list is
# either a corruption or something to look at and add here on purpose.
KNOWN_COMMANDS = frozenset("""
    alpha angle arccos arcsin begin binom bullet cdot cdots cfrac circ clubsuit cos cot cup dbinom dfrac
    diamond displaystyle div dots dotsb dotsm end equiv frac gcd ge geq hline in infty lambda lceil ldots le
    left leq lfloor log mathbf mathcal mathop mathrm mbox multicolumn neq not omega operatorname over
    overline overrightarrow parallel perp phi pi pm pmod prime prod qquad quad rceil rfloor right sec sin
    sqrt square star sum tan text textbf textit tfrac theta times to triangle underbrace underline
""".split()) | {
    "bold",     # MATH-500 (precalculus vectors): the MATH dataset's own macro for a bold letter, not LaTeX's
    "overarc",  # AIME 2025 II-5: an arc over DE, as the AoPS wiki writes it (the `arcs` package's command)
}
# `\` followed by a non-letter: line break, control space, escaped specials, thin spaces, display math.
KNOWN_SYMBOLS = frozenset("\\ !$%&()[],;:{}|#_")
# Literal tabs in two MATH-500 texts, as in the PRM800K source (its data are frozen): the indentation of
# Asymptote code, and tabs between words. Neither is a `\t` escape eating a command's first letter.
TABS_IN_SOURCE = {"test/precalculus/1199.json", "test/geometry/843.json"}


def latex_problems(text: str) -> list[str]:
    """What is wrong with `text` as LaTeX (empty when nothing is): one short line per problem found."""
    out = [f"control character {ch!r} at {i}" for i, ch in enumerate(text)
           if unicodedata.category(ch) == "Cc" and ch != "\n"]
    depth, dollars, envs, display = 0, 0, [], []
    for m in re.finditer(r"\\([A-Za-z]+\*?|.)|[{}$]", text, flags=re.S):
        tok, name = m.group(), m.group(1)
        if name is None:
            if tok == "$":
                dollars += 1
            else:
                depth += 1 if tok == "{" else -1
                if depth < 0:
                    out.append(f"'}}' without '{{' at {m.start()}")
                    depth = 0
        elif name[:1].isalpha():
            if name.rstrip("*") not in KNOWN_COMMANDS:
                out.append(f"unknown command \\{name}")
            if name in ("begin", "end"):
                env = re.match(r"\{([A-Za-z*]+)\}", text[m.end():])
                if env is None:
                    out.append(f"\\{name} without an environment name at {m.start()}")
                elif name == "begin":
                    envs.append(env.group(1))
                elif not envs or envs.pop() != env.group(1):
                    out.append(f"\\end{{{env.group(1)}}} does not close the open environment")
        elif name not in KNOWN_SYMBOLS:
            out.append(f"unknown control symbol {tok!r}")
        elif name in "[(":
            display.append(name)
        elif name in "])":
            if not display or display.pop() != {"]": "[", ")": "("}[name]:
                out.append(f"'\\{name}' closes nothing")
    if depth:
        out.append(f"{depth} '{{' never closed")
    if dollars % 2:
        out.append("an odd number of '$'")
    out += [f"\\begin{{{e}}} never closed" for e in envs] + [f"'\\{d}' never closed" for d in display]
    out += _lost_line_breaks(text)
    return out


def _lost_line_breaks(text: str) -> list[str]:
    """A `\\\\` (row break) read as `\\` leaves a control space before an alignment tab, or a cases
    row with two tabs (cases has two columns)."""
    out = []
    if re.search(r"(?<!\\)\\ \s*&", text):
        out.append("a control space right before '&' (a lost '\\\\' row break)")
    for body in re.findall(r"\\begin\{cases\}(.*?)\\end\{cases\}", text, flags=re.S):
        if any(row.count("&") > 1 for row in body.split("\\\\")):
            out.append("a cases row with more than one '&' (a lost '\\\\' row break)")
    return out


def _rows(name: str) -> list[dict]:
    path = data_module.default_data_path() if name == "math500" else aime_data_path(name)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", DATASETS)
def test_every_problem_text_is_clean_latex(name):
    bad = {}
    for r in _rows(name):
        found = latex_problems(r["problem"])
        if r["unique_id"] in TABS_IN_SOURCE:
            found = [p for p in found if not p.startswith("control character '\\t'")]
        if found:
            bad[r["unique_id"]] = found
    assert not bad, bad
    assert all("\t" in r["problem"] for r in _rows("math500") if r["unique_id"] in TABS_IN_SOURCE)


@pytest.mark.parametrize("name", DATASETS)
def test_every_answer_is_clean_and_parses(name):
    rows = _rows(name)
    bad = {r["unique_id"]: p for r in rows if (p := latex_problems(r["answer"]))}
    assert not bad, bad
    for r in rows:
        parse(canonical(r["answer"]))  # the grader's reading of a gold answer must not raise
    if name != "math500":
        assert all(re.fullmatch(r"0|[1-9][0-9]{0,2}", r["answer"]) for r in rows)


@pytest.mark.parametrize("text, problem", [
    ("The product $\x0crac{1}{2}$", "control character '\\x0c'"),
    ("circumcircle of $\triangle DEF$", "control character '\\t'"),
    ("$\\fracc{1}{2}$", "unknown command \\fracc"),
    ("$\\frac{1}{2$", "'{' never closed"),
    ("$x}$", "'}' without '{'"),
    ("Find $N$ and $2025$.$", "odd number of '$'"),
    ("\\begin{align*} a &= 5 \\ &b = 3 \\end{align*}", "lost '\\\\' row break"),
    ("\\[f(x) = \\begin{cases} x & a \\ 2 - x & b\\end{cases}\\]", "cases row with more than one '&'"),
    ("\\begin{align*} a \\end{cases}", "does not close"),
    ("\\[ x = 1", "'\\[' never closed"),
    ("a \\@ b", "unknown control symbol"),
])
def test_the_latex_check_finds_each_kind_of_damage(text, problem):
    assert any(problem in p for p in latex_problems(text)), latex_problems(text)


@pytest.mark.parametrize("text", [
    "$\\frac{1}{2}$ and \\(x\\) and \\[y\\]",
    "\\begin{align*} &|z| = 5 \\\\ &|z - 4| = 1 \\end{align*}",
    "\\(81 = \\underline{6} \\ \\underline{3}_{13}\\) costs \\$5, 50\\%",
    "x_{4}&=523,\\ \\text{and}\\\\ x_{n}&=1",
])
def test_the_latex_check_accepts_clean_text(text):
    assert latex_problems(text) == []


# --------------------------------------------------------------------------------------------
# AIME provenance
# --------------------------------------------------------------------------------------------


def _provenance(name: str) -> dict:
    return json.loads(provenance_path(name).read_text(encoding="utf-8"))


def test_math500_provenance_names_the_frozen_data():
    prov = _provenance("math500")
    data = data_module.default_data_path().read_bytes()
    assert prov["sha256"] == sha256_hex(data) == DATASET_SHA256 and prov["rows"] == dataset_size("math500")
    assert prov["file"] == data_module.default_data_path().name


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_provenance_names_the_data_it_describes(name):
    prov = _provenance(name)
    data = aime_data_path(name).read_bytes()
    assert prov["dataset"] == name and prov["file"] == aime_data_path(name).name
    assert prov["sha256"] == sha256_hex(data) == AIME_SHA256[name]
    assert sorted(prov["replaces_sha256"]) == sorted(AIME_REPLACED_SHA256[name])
    assert prov["rows"] == len(load_aime(name)) == dataset_size(name)


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_every_aime_answer_cites_an_answer_key_that_agrees(name):
    prov = _provenance(name)
    problems = load_aime(name)
    assert [p["unique_id"] for p in prov["problems"]] == [p.unique_id for p in problems]
    for entry, problem in zip(prov["problems"], problems):
        assert entry["answer"] == problem.answer
        checks = entry["answer_checked_against"]
        assert checks, f"{problem.unique_id}: no answer key cited"
        for check in checks:
            key = prov["answer_keys"][check["key"]]
            assert key.get("url") or (key["repo"] and re.fullmatch(r"[0-9a-f]{40}", key["commit"]) and key["paths"])
            assert int(check["answer"]) == int(problem.answer), (problem.unique_id, check)
        assert entry["text_compared_with"], f"{problem.unique_id}: text compared with nothing"


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_reversing_the_recorded_repairs_gives_back_the_old_copy(name):
    """The repairs listed per problem are exactly the bytes that changed: undoing them reproduces
    the copy shipped before (whose hash the provenance and `AIME_REPLACED_SHA256` keep)."""
    prov = _provenance(name)
    by_id = {e["unique_id"]: e for e in prov["problems"]}
    rows = _rows(name)
    for row in rows:
        for rep in by_id[row["unique_id"]].get("repairs", []):
            assert rep["repaired"] in row["problem"] and rep["damaged"] not in row["problem"]
            assert rep["checked_against"] and rep["what"]
            row["problem"] = row["problem"].replace(rep["repaired"], rep["damaged"])
    old = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
    assert sha256_hex(old) in AIME_REPLACED_SHA256[name]


def test_the_reported_aime25_damage_is_repaired():
    texts = {p.unique_id: p.problem for p in load_aime("aime25")}
    assert texts["2025-II-4"].count("\\frac{") == 5 and "\\triangle DEF$ intersects" in texts["2025-II-5"]
    assert "expressed as $\\frac{m}{n}$" in texts["2025-II-13"]
    assert "= 5 \\\\ &|z - 4 - k|" in texts["2025-I-8"] and "x < 1 \\\\ 2 - x" in texts["2025-I-11"]
    inside = next(p.problem for p in load_aime("aime24") if p.unique_id == "2024-II-8")
    assert "rests on the inside of $S$, it is internally tangent" in inside


def test_the_copy_from_before_the_repair_is_named_as_such(tmp_path, monkeypatch):
    prov = _provenance("aime25")
    rows = _rows("aime25")
    for row, entry in zip(rows, prov["problems"]):
        for rep in entry.get("repairs", []):
            row["problem"] = row["problem"].replace(rep["repaired"], rep["damaged"])
    old = tmp_path / "aime25.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    monkeypatch.setattr(data_module, "aime_data_path", lambda name: old)
    with pytest.raises(ProtocolError, match="copy before its text repairs"):
        load_aime("aime25")


# --------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, limit", [("aime24", 100), ("aime25", 31), ("math500", 501)])
def test_a_limit_beyond_the_dataset_is_refused(name, limit):
    with pytest.raises(ProtocolError, match=f"--limit {limit} is more than the {dataset_size(name)} problems"):
        check_limit(name, limit)


@pytest.mark.parametrize("name, limit", [("aime24", 30), ("aime25", 1), ("math500", 500), ("aime24", None)])
def test_a_limit_within_the_dataset_is_accepted(name, limit):
    check_limit(name, limit)
    assert len(load_dataset(name)) == dataset_size(name)


def test_limit_of_an_unknown_dataset_is_refused():
    with pytest.raises(ProtocolError, match="unknown dataset"):
        check_limit("aime23", 5)



# --------------------------------------------------------------------------------------------
# A plan registered on the copy from before the repair
# --------------------------------------------------------------------------------------------

# sha256 of splits/aime25/manifest.json as committed before the repair (it named the old data hash)
OLD_AIME25_MANIFEST = "a469aae31fe34c1fb16004c57d810592c91166db65409eba0980a6671bf8cbf5"


def test_a_plan_registered_on_the_old_aime25_copy_is_refused_in_one_line(tmp_path):
    plan = prereg.build_plan(
        models=["qwen-1.5b"], budgets=[256], treatment={"scorer": "alpha", "accounting": "mean"},
        baseline={"scorer": "triattention", "accounting": "mean"}, k=1, seed=0, max_new_tokens=64,
        manifest_hash=OLD_AIME25_MANIFEST, code_version="0.1.0+gtest", boot=2000, boot_max=2000,
        dataset="aime25")
    path, _, _ = prereg.write_plan(plan, tmp_path / "plans")
    assert manifest_sha256(dataset="aime25") != OLD_AIME25_MANIFEST
    calls = []
    out = tmp_path / "confirm"
    with pytest.raises(ProtocolError) as err:
        prereg.confirm(path, out, lambda *a: calls.append(a), code_version="0.1.0+gtest")
    assert str(err.value) == (f"split manifest {manifest_sha256(dataset='aime25')[:12]} differs from the "
                              f"registered {OLD_AIME25_MANIFEST[:12]}: refusing to confirm")
    assert calls == [] and not out.exists()
