"""The 1.5B budget ladder (`results/ladder-qwen1.5b/`, issue 44 item 3) recomputed from its records alone.

Every figure of the README's table is computed again here with code of this test's own (`arm_figures`, not
`protocol.diagnostics`, which `scripts/ladder_table.py` used to print the table): accuracy, acc_strict,
the truncated, looping and compacted shares, the share of each answer written after its first compaction
(from the cache traces), the prompt held at the end, the mean cache and the mean output length; and the
full cache's truncation at shorter limits. Each committed run has its row and each row its run. The slow
test grades every answer again from its text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from protocol import grading
from protocol.data import load_problems
from tests.committed.arm_figures import figures, jsonl, pct, table_rows

FOLDER = Path(__file__).resolve().parents[2] / "results" / "ladder-qwen1.5b"


def _runs() -> dict[tuple[str, str], Path]:
    """(scorer, budget or "full") -> run folder."""
    out = {}
    for d in sorted((FOLDER / "runs").iterdir()):
        cfg = json.loads((d / "config.json").read_text())["config"]
        out[(cfg["scorer"], "full" if cfg["budget"] is None else str(cfg["budget"]))] = d
    return out


def _table() -> dict[tuple[str, str], list[str]]:
    # the table names the prompt rule of random-pp; the runs are keyed by scorer
    return {(arm.removesuffix("+pp-in"), b): cells for (arm, b), cells in table_rows(FOLDER / "README.md").items()}


def test_every_run_has_its_row_and_every_row_its_run():
    assert set(_runs()) == set(_table())


@pytest.mark.parametrize("arm", sorted(_runs()) if (FOLDER / "runs").is_dir() else [])
def test_table_row_is_its_records(arm):
    run = _runs()[arm]
    cfg = json.loads((run / "config.json").read_text())["config"]
    recs = jsonl(run / "records.jsonl")
    assert len({(r["problem_id"], r["sample"]) for r in recs}) == len(recs) == cfg["limit"]
    assert figures(run) == _table()[arm]


def test_full_cache_truncation_at_shorter_limits():
    recs = jsonl(_runs()[("full", "full")] / "records.jsonl")
    limit = json.loads((_runs()[("full", "full")] / "config.json").read_text())["config"]["max_new_tokens"]
    line = next(x for x in (FOLDER / "README.md").read_text().splitlines() if x.startswith("full cache, truncated at"))
    for L in (512, 768, limit):
        cut = sum(r["output_tokens"] > L or (r["output_tokens"] == L and r["finish_reason"] == "length") for r in recs)
        assert f"L={L}: {pct(cut / len(recs))}%" in line


@pytest.mark.slow
def test_every_verdict_graded_again_from_its_text():
    problems = {p.unique_id: p.problem for p in load_problems()}
    for run in _runs().values():
        for r in jsonl(run / "records.jsonl"):
            g = grading.grade(r["text"], r["gold"], problem=problems[r["problem_id"]], finish_reason=r["finish_reason"])
            assert (g.verdict is True) == (r["verdict"] is True), (run.name, r["problem_id"])


def _paired_rows() -> dict[tuple[str, str], list[str]]:
    """The README's "arm vs full" table: (scorer, budget) -> [Δ pp, CI, p, verdict]."""
    names = {"TriAttention": "triattention", "α": "alpha", "random-pp": "random-pp"}
    rows = {}
    for line in (FOLDER / "README.md").read_text().splitlines():
        m = re.fullmatch(r"\| (\S+) (\d+) \| ([-+0-9.]+) \| (\[.*\]) \| (\S+) \| (\S+) \|", line.strip())
        if m and m.group(1) in names:
            rows[(names[m.group(1)], m.group(2))] = [m.group(3), m.group(4), m.group(5), m.group(6)]
    return rows


def test_paired_differences_are_the_records_and_the_report():
    """Each Δ recomputed from the paired records; its CI, p and verdict are the committed report's."""
    runs, rows = _runs(), _paired_rows()
    assert set(rows) == {arm for arm in runs if arm != ("full", "full")}
    base = {(r["problem_id"], r["sample"]): r["verdict"] is True for r in jsonl(runs[("full", "full")] / "records.jsonl")}
    report = (FOLDER / "report.txt").read_text().splitlines()
    for (scorer, budget), (delta, ci, p, verdict) in rows.items():
        arm = {(r["problem_id"], r["sample"]): r["verdict"] is True for r in jsonl(runs[(scorer, budget)] / "records.jsonl")}
        assert set(arm) == set(base)
        assert f"{100 * (sum(arm.values()) - sum(base.values())) / len(arm):+.2f}" == delta
        label = "random-pp+pp-in" if scorer == "random-pp" else scorer
        (line,) = [x for x in report if f"{budget} vs full" in x and f" {label} vs full " in x]
        cells = line.split()
        assert delta in cells and p in cells and verdict in cells and " ".join(ci.split()) in " ".join(cells)


def test_guessing_baseline():
    """Golds 0..6: their share of the problems, and of each arm's correct answers, as the README states."""
    small = re.compile(r"[0-6]")
    text = (FOLDER / "README.md").read_text()
    recs = {arm: jsonl(run / "records.jsonl") for arm, run in _runs().items()}
    golds = [small.fullmatch(str(r["gold"]).strip().strip("$").strip()) is not None for r in recs[("full", "full")]]
    assert f"{pct(sum(golds) / len(golds))}% of these 64 problems" in text
    share = {arm: (lambda right: sum(small.fullmatch(str(r["gold"]).strip()) is not None for r in right) / len(right))(
        [r for r in rs if r["verdict"] is True]) for arm, rs in recs.items()}
    assert f"{pct(share[('full', 'full')])}% of the full cache's correct answers" in text
    at256 = sorted(round(100 * v) for (s, b), v in share.items() if b == "256")
    assert f"{at256[0]}–{at256[-1]}% of the 256 arms'" in text
    assert (f"{round(100 * share[('alpha', '128')])}% (α), {round(100 * share[('triattention', '128')])}% (TriAttention) "
            f"and {round(100 * share[('random-pp', '128')])}% (`random-pp`)") in " ".join(text.split())
