"""The committed design-space run (`results/design-space-qwen0.5b/`) recomputed from its records alone.

Each arm of the README's table is found by its configuration (scorer and the mechanism of each
family, accounting), not by its label; its accuracy is re-graded from the records' texts, its cache
figures are the means of the records' own meters, Δ is the paired difference with the baseline, and
the CI and p of `report/design_space.csv` are checked against a plain cluster bootstrap written here
(resampling problems with replacement), not the protocol's. The iso-cache columns are the same
comparison between the arms' `prefill`-accounting twins.
"""

from __future__ import annotations

import csv
import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests.committed.test_dev_runs import _records as run_records
from tests.committed.test_dev_runs import regraded

FOLDER = Path(__file__).resolve().parents[2] / "results" / "design-space-qwen0.5b"
N = 64
BASELINE = ("triattention", None, None, None, None)
MECHANISMS = ("scoring", "routing", "state", "cadence", "decoding")  # the order of an arm's tuple below
# README label: (family, (scorer, routing, state, cadence, decoding))
ARMS = {
    "alpha": ("scoring", ("alpha", None, None, None, None)),
    "newline": ("cadence", ("triattention", None, None, "newline", None)),
    "adakv": ("routing", ("triattention", "adakv", None, None, None)),
    "pyramidkv": ("routing", ("triattention", "pyramidkv", None, None, None)),
    "merge": ("state", ("triattention", None, "merge", None, None)),
    "quant int8 (same KiB)": ("state", ("triattention", None, "quant", None, None)),
    "loop-guard": ("decoding", ("triattention", None, None, None, "loop-guard")),
}


def _name(entry) -> str | None:
    return entry.get("name") if isinstance(entry, dict) else entry


@cache
def _runs() -> dict[tuple, Path]:
    """(mechanisms, accounting) -> run folder, for every run under runs/ (each identity once)."""
    out: dict[tuple, Path] = {}
    for d in sorted((FOLDER / "runs").iterdir()):
        c = json.loads((d / "config.json").read_text())["config"]
        key = ((c["scorer"], *(_name(c.get(f)) for f in ("routing", "state", "cadence", "decoding"))), c["accounting"])
        assert key not in out, f"two runs of {key}: {out[key].name} and {d.name}"
        out[key] = d
    return out


@cache
def _records(mechs: tuple, accounting: str) -> tuple[dict, ...]:
    return tuple(run_records(_runs()[mechs, accounting]))


@cache
def _correct(mechs: tuple, accounting: str) -> dict[tuple, bool]:
    """Each record's verdict re-graded from its text (and checked against the recorded one)."""
    recs = _records(mechs, accounting)
    verdicts = regraded(recs)
    assert verdicts == [r["verdict"] is True for r in recs], (mechs, accounting)
    return {(r["problem_id"], r["sample"]): ok for r, ok in zip(recs, verdicts)}


def _mean(mechs: tuple, accounting: str, field: str) -> float:
    return float(np.mean([r[field] for r in _records(mechs, accounting)]))


def _diffs(mechs: tuple, accounting: str) -> np.ndarray:
    """(N,) paired differences treatment - baseline per problem (k = 1 sample each)."""
    t, b = _correct(mechs, accounting), _correct(BASELINE, accounting)
    assert set(t) == set(b) and len(t) == N
    return np.array([int(t[k]) - int(b[k]) for k in sorted(t)])


def _readme_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (FOLDER / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 2 and cells[1] in ARMS:
            rows[cells[1]] = cells
    return rows


def _csv_rows() -> dict[str, dict]:
    with open(FOLDER / "report" / "design_space.csv", newline="") as f:
        return {r["mechanisms"]: r for r in csv.DictReader(f)}


def _pp(x: float) -> str:
    return f"{x:+.2f}".replace("-", "−")


def test_every_run_holds_its_budget_on_the_same_problems():
    keys = None
    for (mechs, accounting), _d in _runs().items():
        recs = _records(mechs, accounting)
        assert len(recs) == N and {r["slots"] for r in recs} == {64}
        assert keys is None or {(r["problem_id"], r["sample"]) for r in recs} == keys
        keys = {(r["problem_id"], r["sample"]) for r in recs}
        if accounting == "mean" and mechs[0] != "full":
            assert not any(r["budget_exceeded"] for r in recs), mechs


@pytest.mark.parametrize("label", sorted(ARMS))
def test_readme_row_is_its_records(label):
    family, mechs = ARMS[label]
    cells = _readme_rows()[label]
    assert cells[0] == family
    acc_t, acc_b = (100 * np.mean(list(_correct(m, "mean").values())) for m in (mechs, BASELINE))
    assert cells[2] == f"{acc_t:.1f} / {acc_b:.1f}"
    delta = 100 * _diffs(mechs, "mean").mean()
    assert cells[3].startswith(_pp(delta) + " [")
    tok_t, tok_b = (_mean(m, "mean", "cache_mean_tokens") for m in (mechs, BASELINE))
    assert cells[6] == f"{tok_t:.1f} / {tok_b:.1f}"
    kib_t, kib_b = (_mean(m, "mean", "cache_mean_kib") for m in (mechs, BASELINE))
    assert cells[7] == f"{kib_t:.0f} / {kib_b:.0f}"
    assert cells[8] == f"{_mean(mechs, 'mean', 'cache_mean_buffer_tokens'):.1f}"
    if mechs[2] == "quant":  # at the KiB of 128 full-precision tokens, holding more tokens than 128
        assert kib_t <= 1536 and tok_t > 128
    iso = 100 * _diffs(mechs, "prefill").mean()
    iso_tokens = _mean(mechs, "prefill", "cache_mean_tokens")
    assert cells[9].startswith(f"{_pp(iso)} pp") and cells[9].endswith(f"{iso_tokens:.1f} / "
                                                                       f"{_mean(BASELINE, 'prefill', 'cache_mean_tokens'):.1f}")


@pytest.mark.parametrize("label", sorted(ARMS))
def test_csv_ci_and_p_agree_with_an_independent_bootstrap(label):
    family, mechs = ARMS[label]
    row = _csv_rows()[f"{family}={mechs[MECHANISMS.index(family)]}"]
    for accounting, p_col in (("mean", "p_bootstrap"), ("prefill", "iso_prefill_p")):
        d = _diffs(mechs, accounting)
        rng = np.random.default_rng(1)
        B = 20_000
        sums = d[rng.integers(0, N, size=(B, N))].sum(axis=1)  # problems drawn with replacement
        s = int(d.sum())
        p = (1 + int(np.sum(np.abs(sums - s) >= abs(s)))) / (B + 1)
        assert abs(float(row[p_col]) - p) <= max(4 * np.sqrt(p * (1 - p) / B), 0.01), (accounting, row[p_col], p)
        if accounting == "mean":
            assert abs(float(row["delta_pp"]) - 100 * d.mean()) < 1e-9
            lo, hi = np.quantile(sums / N, [0.025, 0.975], method="inverted_cdf") * 100
            step = 100 / N  # a CI endpoint moves in steps of one problem
            assert abs(float(row["ci95_lo_pp"]) - lo) <= step and abs(float(row["ci95_hi_pp"]) - hi) <= step
        else:
            assert abs(float(row["iso_prefill_delta_pp"]) - 100 * d.mean()) < 1e-9
