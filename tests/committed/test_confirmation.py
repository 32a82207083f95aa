"""The committed confirmation (`results/first-confirm-qwen0.5b/`) recomputed from its records alone.

Per cell: the accuracies and the McNemar table from the records' verdicts, paired by (problem,
sample), with plain Python; they must equal both ledgers' results (the regenerating plan's and the
first plan's copy from the registry) and the report's CSV. The paired test itself is recomputed
independently in the study acceptance test; here the point is that the committed figures are the
records' figures.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.committed.arm_figures import jsonl

FOLDER = Path(__file__).resolve().parents[2] / "results" / "first-confirm-qwen0.5b"
CELLS = {"qwen2.5-coder-0.5b@b128": 128, "qwen2.5-coder-0.5b@b256": 256}


def _verdicts(run_dir: Path) -> dict[tuple[str, int], bool]:
    return {(r["problem_id"], r["sample"]): r["verdict"] is True for r in jsonl(run_dir / "records.jsonl")}


def _cells(ledger: Path) -> dict[str, dict]:
    return {e["cell_id"]: e for e in jsonl(ledger) if e.get("kind") == "cell"}


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_committed_confirmation_is_its_records(cell):
    new = _cells(FOLDER / "confirm" / "ledger.jsonl")[cell]
    first = _cells(FOLDER / "registry-b9c54459be6c" / "ledger.jsonl")[cell]
    runs = {arm: FOLDER / "confirm" / new["runs"][arm]["path"] for arm in ("treatment", "baseline")}
    t, b = _verdicts(runs["treatment"]), _verdicts(runs["baseline"])
    assert set(t) == set(b) and len(t) == 299  # every confirm problem, once, in both arms
    table = {"n11": sum(t[k] and b[k] for k in t), "n10": sum(t[k] and not b[k] for k in t),
             "n01": sum(b[k] and not t[k] for k in t), "n00": sum(not t[k] and not b[k] for k in t)}
    acc_t, acc_b = sum(t.values()) / len(t), sum(b.values()) / len(b)
    for ledger in (new, first):
        res = ledger["result"]
        assert (res["n"], res["k"]) == (299, 1)
        assert res["acc_treatment"] == pytest.approx(acc_t, abs=1e-12)
        assert res["acc_baseline"] == pytest.approx(acc_b, abs=1e-12)
        assert res["estimate"] == pytest.approx(acc_t - acc_b, abs=1e-12)
        assert {k: res["mcnemar"][k] for k in table} == table
    assert new["result"] == first["result"]  # the regenerated cell is the first one
    row = next(r for r in csv.DictReader((FOLDER / "report" / "report.csv").open())
               if int(r["budget"]) == CELLS[cell])
    assert float(row["delta_pp"]) == pytest.approx(100 * (acc_t - acc_b), abs=1e-9)
    assert float(row["p_bootstrap"]) == pytest.approx(new["result"]["p_bootstrap"], abs=1e-12)
    assert row["verdict"] == "n.s." and not new["result"]["reject"]
