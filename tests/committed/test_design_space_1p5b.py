"""`results/design-space-qwen1.5b/` (in progress): the README's rows from the records, and the arms that
repeat a ladder arm's first 64 problems reproduce its records exactly (another commit, another run size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "results" / "design-space-qwen1.5b"
LADDER = ROOT / "results" / "ladder-qwen1.5b" / "runs"
RUNS = sorted(p for p in (FOLDER / "runs").glob("*") if (p / "records.jsonl").exists())


def _records(run: Path) -> dict[str, dict]:
    return {r["problem_id"]: r for r in map(json.loads, (run / "records.jsonl").read_text().splitlines())}


def test_every_committed_arm_is_whole():
    assert RUNS
    for run in RUNS:
        recs = _records(run)
        assert len(recs) == 128 and len({r["config_hash"] for r in recs.values()}) == 1


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_readme_row_from_the_records(run):
    cfg = json.loads((run / "config.json").read_text())["config"]
    recs = list(_records(run).values())
    n, right = len(recs), sum(r["verdict"] is True for r in recs)
    cut = sum(r["finish_reason"] == "length" for r in recs)
    mean_cache = sum(r["cache_mean_tokens"] for r in recs) / n
    mean_out = sum(r["output_tokens"] for r in recs) / n
    row = (f"| {cfg['scorer']} | {cfg['budget'] if cfg.get('budget') is not None else 'full'} | "
           f"{100 * right / n:.1f} ({right}/{n}) |")
    readme = (FOLDER / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith(row))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[4] == f"{100 * cut / n:.1f}"
    assert cells[9] == f"{mean_cache:.1f}" and cells[10] == f"{mean_out:.0f}"


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_the_ladder_arm_of_the_same_cell_is_reproduced(run):
    cfg = json.loads((run / "config.json").read_text())["config"]
    cell = {k: v for k, v in cfg.items() if k != "limit"}  # the ladder ran the first 64 of the same problems
    twins = [p for p in LADDER.glob("*")
             if {k: v for k, v in json.loads((p / "config.json").read_text())["config"].items() if k != "limit"} == cell]
    if not twins:
        pytest.skip("no ladder arm of this configuration")
    ours, theirs = _records(run), _records(twins[0])
    assert len(theirs) == 64 and set(theirs) <= set(ours)
    for pid, r in theirs.items():
        mine = ours[pid]
        for k in ("output_token_ids", "text", "verdict", "cache_mean_tokens", "compactions", "seed"):
            assert mine[k] == r[k], (pid, k)
