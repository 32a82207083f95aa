"""Behaviour kept (issue 20, item 6): the golden runs recorded before the one-runtime refactor.

Every built-in scorer on `tiny-random` and on every tiny layout model, batch 1 and 8, float64,
greedy, fidelity on (`scripts/golden_records.py` says exactly what runs and how). Each model's runs
are re-run and compared with `tests/retention/golden_records/runs.jsonl`: identical token ids,
kept sets (digests; batch 1 in order, batch 8 as a multiset), meter figures and traces exactly
where integer, floats (mean cache, KiB, KL) to 1e-12 relative, and the same one-line refusals.
Rerecord only before the refactor: `python scripts/golden_records.py` (see its docstring).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "golden_records.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("golden_records", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


golden = _load_script()


@pytest.mark.parametrize("model", golden.MODELS)
def test_golden_runs_reproduce(model):
    recorded = [r for r in golden.load_recorded() if r["model"] == model]
    assert len(recorded) == len(golden.SCORERS) * len(golden.BATCH_SIZES)
    fresh = golden.record_model(model)
    # The hook saw one kept set per row and compaction the meter counted (it cannot pass empty).
    for run in fresh:
        if run["refusal"] is None:
            assert len(run["kept"]) == sum(r["compactions"] for r in run["records"])
    key = lambda r: (r["scorer"], r["batch_size"])  # noqa: E731
    by_key = {key(r): r for r in recorded}
    assert sorted(by_key) == sorted(map(key, fresh))
    diffs = [d for r in fresh
             for d in golden.differences(by_key[key(r)], r, f"{model}/{r['scorer']}/b{r['batch_size']}")]
    assert diffs == []


def test_recorded_runs_cover_the_matrix():
    """Every (model, scorer, batch) is recorded; evicting runs compacted; refusals are one Error line."""
    runs = golden.load_recorded()
    keys = {(r["model"], r["scorer"], r["batch_size"]) for r in runs}
    assert keys == {(m, s, b) for m in golden.MODELS for s in golden.SCORERS for b in golden.BATCH_SIZES}
    assert all(r["dtype"] == "float64" for r in runs)
    for r in runs:
        if r["refusal"] is not None:
            assert r["model"] != "tiny-random" and r["refusal"].startswith("Error: ") and "\n" not in r["refusal"]
            continue
        assert len(r["records"]) == golden.LIMIT
        for rec in r["records"]:
            assert len(rec["output_token_ids"]) == golden.MAX_NEW_TOKENS
            assert (rec["compactions"] > 0) == (r["scorer"] != "full")
            assert rec["fidelity"]["steps"] == golden.MAX_NEW_TOKENS
    # Kept sets are batch invariant today: the batch-8 multiset equals the batch-1 events.
    by = {(r["model"], r["scorer"], r["batch_size"]): r for r in runs if r["refusal"] is None}
    for (m, s, b), r in by.items():
        if b == 1:
            assert sorted(map(tuple, r["kept"])) == [tuple(e) for e in by[(m, s, 8)]["kept"]]


def test_comparison_catches_changes():
    """The comparison is not vacuous: a changed token, kept set, count or float beyond 1e-12 fails."""
    run = next(r for r in golden.load_recorded() if r["refusal"] is None and r["scorer"] == "h2o")
    assert golden.differences(run, copy.deepcopy(run)) == []
    def tokens(r):
        r["records"][0]["output_token_ids"][3] += 1

    def kept(r):
        r["kept"][1][1] = "0" * 16

    def compactions(r):
        r["records"][1]["compactions"] += 1

    def kl(r):
        r["records"][0]["fidelity"]["kl_mean"] *= 1 + 1e-10

    def mean_cache(r):
        r["records"][0]["cache_mean_tokens"] += 1e-9

    def refusal(r):
        r["refusal"] = "Error: no"

    for mutate in (tokens, kept, compactions, kl, mean_cache, refusal):
        changed = copy.deepcopy(run)
        mutate(changed)
        assert golden.differences(run, changed) != [], mutate.__name__
    close = copy.deepcopy(run)
    close["records"][0]["fidelity"]["kl_mean"] *= 1 + 1e-14
    assert golden.differences(run, close) == []
