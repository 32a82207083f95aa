"""Every committed plan and run configuration keeps its hash under the canonical-number rule
(`protocol.numbers`) and the cell identity (`protocol.plans.cell_identity`): the plans' stored hashes,
the ledgers' cell keys and the run configurations' hashes are recomputed from the files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.io import canonical_json, sha256_text
from protocol.numbers import canonical_value
from protocol.plans import cell_identity, cell_key, load_plan, plan_hash

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted(p for p in (ROOT / "results").rglob("plan*.json"))
CONFIGS = sorted((ROOT / "results").rglob("config.json"))
LEDGERS = sorted((ROOT / "results").rglob("ledger.jsonl"))


def test_there_is_something_to_check():
    assert PLANS and CONFIGS and LEDGERS


@pytest.mark.parametrize("path", PLANS, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_plan_keeps_its_hash_and_canonical_numbers(path):
    plan, h = load_plan(path)  # refuses a body that no longer hashes to its stored hash
    # The rule is for settings; `power` (preregister --dev/--time-slots) records measured figures (MDEs, step
    # times) as measured: hashed as written, not settings two spellings of which could be one cell.
    settings = {k: v for k, v in plan.items() if k != "power"}
    assert canonical_value(settings) == json.loads(canonical_json(settings))
    assert plan_hash(plan) == h


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_run_configuration_keeps_its_hash(path):
    doc = json.loads(path.read_text())
    config = doc["config"]
    assert sha256_text(canonical_json(config)) == doc["config_hash"]
    # Its numbers are already canonical: building it again records the same values, so the same hash.
    assert sha256_text(canonical_json(canonical_value(config))) == doc["config_hash"]


def _ledger_cells():
    out = []
    for ledger in LEDGERS:
        for line in ledger.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("kind") == "cell" and entry.get("cell_key") and entry.get("cell_identity"):
                out.append((ledger, entry))
    return out


CELLS = _ledger_cells()


def test_committed_ledgers_have_cells():
    assert CELLS


@pytest.mark.parametrize("ledger,entry", CELLS, ids=lambda x: x["cell_id"] if isinstance(x, dict) else x.parent.name)
def test_committed_cell_keeps_its_key(ledger, entry):
    assert cell_key(entry["cell_identity"]) == entry["cell_key"]
    plans = {load_plan(p)[1]: load_plan(p)[0] for p in PLANS}
    plan = plans.get(entry["plan_hash"])
    if plan is not None:  # the plan file is committed too: its cell's identity recomputes to the key
        cell = next(c for c in plan["cells"] if c["id"] == entry["cell_id"])
        assert cell_identity(plan, cell) == entry["cell_identity"]
        assert cell_key(cell_identity(plan, cell)) == entry["cell_key"]
