"""`results/design-space-qwen1.5b/` (in progress): every figure of the README's table recomputed from the records
and traces (`arm_figures`, code of the tests' own), every committed arm whole and in the table, and the arms that
repeat a ladder arm's first 64 problems reproduce its records exactly (another commit, another run size)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.runs import assign_labels, load_run
from tests.committed.arm_figures import figures, jsonl, table_rows

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "results" / "design-space-qwen1.5b"
LADDER = ROOT / "results" / "ladder-qwen1.5b" / "runs"
RUNS = sorted(p for p in (FOLDER / "runs").glob("*") if (p / "records.jsonl").exists())


def _records(run: Path) -> dict[str, dict]:
    return {r["problem_id"]: r for r in jsonl(run / "records.jsonl")}


def _arms() -> dict[tuple[str, str], Path]:
    """(label, budget or "full") -> run folder; the label (scorer and what sets the arm apart) is the report's."""
    runs = [load_run(p) for p in RUNS]
    assign_labels(runs)
    return {(r.label, "full" if r.budget is None else str(r.budget)): p for r, p in zip(runs, RUNS)}


def test_every_committed_arm_is_whole_and_has_its_row():
    assert RUNS
    for run in RUNS:
        recs = _records(run)
        assert len(recs) == 128 and len({r["config_hash"] for r in recs.values()}) == 1
    assert set(_arms()) == set(table_rows(FOLDER / "README.md"))


@pytest.mark.parametrize("arm", sorted(_arms()), ids=lambda a: f"{a[0]}-{a[1]}")
def test_readme_row_from_the_records(arm):
    assert figures(_arms()[arm]) == table_rows(FOLDER / "README.md")[arm]


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


def test_full_cache_truncation_at_shorter_limits():
    """An answer of the full arm that stopped before L tokens stops at the same place under a limit of L."""
    (run,) = [p for (label, _), p in _arms().items() if label == "full"]
    recs = jsonl(run / "records.jsonl")
    line = next(x for x in (FOLDER / "README.md").read_text().splitlines() if x.startswith("full cache, truncated at"))
    for L in (512, 768, 1024):
        cut = sum(r["output_tokens"] > L or (r["output_tokens"] == L and r["finish_reason"] == "length") for r in recs)
        assert f"L={L}: {100 * cut / len(recs):.1f}%" in line
