"""The confirmation on Qwen2.5-Coder-1.5B (`results/confirm-qwen1.5b/`, issue 44 item 5) recomputed from its records.

Per cell, with code of this test's own: the accuracies and the McNemar table from the records' verdicts,
paired by (problem, sample), against the ledger and the report's CSV; the exact McNemar p with scipy; the
bootstrap p and 95% CI against an independent resampling of problems (numpy, another seed: they agree within
Monte-Carlo error); the plan's MDE from the dev records and the normal quantiles of the standard library; the
README's rows (accuracy, Δ, CI, p, p_bonf, discordant pairs, acc_strict, truncated, the guessing baseline) and
the predicted and actual wall times.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from statistics import NormalDist, variance

import numpy as np
import pytest
from scipy.stats import binomtest

from tests.committed.arm_figures import jsonl, loops, pct

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "results" / "confirm-qwen1.5b"
DEV = ROOT / "results" / "design-space-qwen1.5b" / "runs"
SMALL = re.compile(r"[0-6]")


def _plans() -> dict[str, dict]:
    return {p.stem.split("-")[1]: json.loads(p.read_text()) for p in sorted((FOLDER / "plans").glob("plan-*.json"))}


def _cells() -> list[dict]:
    return [e for e in jsonl(FOLDER / "confirm" / "ledger.jsonl") if e.get("kind") == "cell"]


def _records(entry: dict, arm: str) -> dict[tuple[str, int], dict]:
    run = FOLDER / "confirm" / entry["runs"][arm]["path"]
    return {(r["problem_id"], r["sample"]): r for r in jsonl(run / "records.jsonl")}


def _pairs(entry: dict) -> tuple[dict, dict]:
    t, b = _records(entry, "treatment"), _records(entry, "baseline")
    assert set(t) == set(b) and len(t) == 299  # every confirm problem, once, in both arms
    return t, b


CELLS = _cells() if (FOLDER / "confirm" / "ledger.jsonl").exists() else []


def test_every_plan_is_confirmed_once():
    assert CELLS and {e["plan_hash"][:12] for e in CELLS} == set(_plans())
    assert len({(e["plan_hash"], e["cell_id"]) for e in CELLS}) == len(CELLS)


@pytest.mark.parametrize("entry", CELLS, ids=lambda e: e["plan_hash"][:12])
def test_cell_result_is_its_records(entry):
    t, b = _pairs(entry)
    tv = {k: r["verdict"] is True for k, r in t.items()}
    bv = {k: r["verdict"] is True for k, r in b.items()}
    table = {"n11": sum(tv[k] and bv[k] for k in tv), "n10": sum(tv[k] and not bv[k] for k in tv),
             "n01": sum(bv[k] and not tv[k] for k in tv), "n00": sum(not tv[k] and not bv[k] for k in tv)}
    res = entry["result"]
    assert (res["n"], res["k"], res["m"]) == (299, 1, 2)
    assert res["acc_treatment"] == pytest.approx(sum(tv.values()) / 299, abs=1e-12)
    assert res["acc_baseline"] == pytest.approx(sum(bv.values()) / 299, abs=1e-12)
    assert res["estimate"] == pytest.approx((sum(tv.values()) - sum(bv.values())) / 299, abs=1e-12)
    assert {k: res["mcnemar"][k] for k in table} == table
    discordant = table["n10"] + table["n01"]
    if discordant:
        assert res["p_mcnemar"] == pytest.approx(binomtest(table["n10"], discordant).pvalue, abs=1e-12)
    # the cluster bootstrap (k = 1: problems resampled) against a resampling of this test's own
    d = np.array([int(tv[k]) - int(bv[k]) for k in sorted(tv)], dtype=float)
    rng = np.random.default_rng(20261208)
    boot = d[rng.integers(0, d.size, size=(20_000, d.size))].mean(axis=1)
    lo, hi = np.quantile(boot, [0.025, 0.975])
    assert res["ci95"][0] == pytest.approx(lo, abs=0.0067) and res["ci95"][1] == pytest.approx(hi, abs=0.0067)
    p_own = min(1.0, 2 * min(np.mean(boot - d.mean() >= abs(d.mean())), np.mean(boot - d.mean() <= -abs(d.mean()))))
    assert abs(res["p_bootstrap"] - p_own) < 4 * math.sqrt(max(p_own * (1 - p_own), 1e-4) / 20_000) + 0.01
    assert res["p_bonferroni"] == pytest.approx(min(1.0, 2 * res["p_bootstrap"]), abs=1e-12)
    row = next(r for r in csv.DictReader((FOLDER / "report" / "report.csv").open())
               if r["treatment_run"] == entry["runs"]["treatment"]["run_id"])
    assert float(row["delta_pp"]) == pytest.approx(100 * res["estimate"], abs=1e-9)
    assert float(row["p_bootstrap"]) == res["p_bootstrap"] and row["verdict"] == ("n.s." if not res["reject"] else row["verdict"])


@pytest.mark.parametrize("name", sorted(_plans()) if (FOLDER / "plans").is_dir() else [])
def test_plan_mde_from_the_dev_records(name):
    plan = _plans()[name]["plan"]
    (cell,) = plan["power"]["cells"].values()
    t = {r["problem_id"]: r["verdict"] is True for r in jsonl(DEV / cell["dev_treatment_run"] / "records.jsonl")}
    b = {r["problem_id"]: r["verdict"] is True for r in jsonl(DEV / cell["dev_baseline_run"] / "records.jsonl")}
    d = [int(t[k]) - int(b[k]) for k in sorted(t)]
    se = math.sqrt(variance(d) / 299)
    z = NormalDist().inv_cdf(1 - 0.05 / (2 * 2)) + NormalDist().inv_cdf(0.8)
    assert cell["mde_pp"] == pytest.approx(100 * z * se, rel=1e-9)
    assert cell["dev_discordance"] == pytest.approx(sum(x != 0 for x in d) / len(d), abs=1e-12)



def _readme_rows(header: str) -> list[list[str]]:
    """The rows of the README's table whose header starts with `header`."""
    lines = (FOLDER / "README.md").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith(header))
    rows = []
    for x in lines[start + 2:]:
        if not x.startswith("|"):
            break
        rows.append([c.strip() for c in x.strip().strip("|").split("|")])
    return rows


def _first_compaction(rec: dict, trace: dict, b: int, n: int) -> int:
    """The output step of the record's first compaction under the fixed cadence (a prompt longer than `b` at
    prefill, else when prompt + output reach `b + n`), checked against the meter's trace (which thins its steps
    on long answers: then the last traced step before it must still grow, the first at or after it have dropped)."""
    at = dict(zip(trace["steps"], trace["tokens"]))
    p = rec["prompt_tokens"]
    step = 0 if p > b else b + n - p
    if step == 0:
        assert at[0] < p + 1
    else:
        before, after = max(k for k in at if k < step), min(k for k in at if k >= step)
        assert at[before] <= b + n and at[after] < at[before], rec["problem_id"]
    return step


def _arm_figures(run: Path) -> list[str]:
    """acc, acc_strict, truncated, looping, compacted, answer after the first compaction, small golds among the
    correct and among the problems (%), mean cache, mean output tokens: the README's diagnostics row."""
    recs = jsonl(run / "records.jsonl")
    traces = {(t["problem_id"], t["sample"]): t for t in jsonl(run / "trace.jsonl")}
    cfg = json.loads((run / "config.json").read_text())["config"]
    n = len(recs)
    right = [r for r in recs if r["verdict"] is True]
    after = [0.0 if not r["compactions"] else
             max(r["output_tokens"] - _first_compaction(r, traces[(r["problem_id"], r["sample"])],
                                                        cfg["nominal_b"], cfg["interval"]), 0) / r["output_tokens"]
             for r in recs]
    small = lambda r: SMALL.fullmatch(str(r["gold"]).strip()) is not None  # noqa: E731
    return [pct(len(right) / n), pct(sum(r["finish_reason"] != "length" for r in right) / n),
            pct(sum(r["finish_reason"] == "length" for r in recs) / n),
            pct(sum(loops(r["output_token_ids"]) for r in recs) / n),
            pct(sum(r["compactions"] > 0 for r in recs) / n), pct(sum(after) / n),
            pct(sum(map(small, right)) / len(right)), pct(sum(map(small, recs)) / n),
            f"{sum(r['cache_mean_tokens'] for r in recs) / n:.1f}", f"{sum(r['output_tokens'] for r in recs) / n:.0f}"]


def test_readme_tables_are_the_records():
    (entry,) = [e for e in CELLS if e["plan_hash"].startswith("6dd9fd53c759")]
    t, b = _pairs(entry)
    tv, bv = ({k: r["verdict"] is True for k, r in x.items()} for x in (t, b))
    (row,) = _readme_rows("| cell |")
    ct, cb = sum(tv.values()), sum(bv.values())
    assert row[1] == f"{pct(ct / 299)} ({ct}/299)" and row[2] == f"{pct(cb / 299)} ({cb}/299)"
    res = entry["result"]
    lo, hi = (100 * x for x in res["ci95"])
    assert row[3] == f"{100 * (ct - cb) / 299:+.2f} [{lo:+.1f}, {hi:+.1f}]".replace("-", "−")
    assert row[4] == f"{res['p_bootstrap']:.3g}" and row[5] == f"{res['p_bonferroni']:.3g}"
    only_t = sum(tv[k] and not bv[k] for k in tv)
    only_b = sum(bv[k] and not tv[k] for k in tv)
    assert row[6] == f"{only_t} / {only_b}"
    plan = _plans()["6dd9fd53c759"]["plan"]
    assert row[7] == f"{plan['power']['cells'][entry['cell_id']]['mde_pp']:.1f}"
    assert row[8] == res["verdict"]
    diag = {r[0]: r[1:] for r in _readme_rows("| arm | acc % | acc_strict %")}
    for name, arm in (("α", "treatment"), ("TriAttention", "baseline")):
        assert diag[name] == _arm_figures(FOLDER / "confirm" / entry["runs"][arm]["path"]), name


def test_predicted_and_actual_wall_time():
    plan = _plans()["6dd9fd53c759"]["plan"]
    predicted = plan["power"]["wall_time"]["total_seconds"]
    actual = int(dict(line.split("\t") for line in (FOLDER / "timings.tsv").read_text().splitlines())["confirm-alpha"])
    text = " ".join((FOLDER / "README.md").read_text().split())
    assert f"**{predicted:,.0f} s**" in text and f"**{actual:,} s**" in text
    assert f"{actual / predicted:.2f}x the prediction" in text
