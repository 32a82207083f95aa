"""Paired statistics: reference values, exact identities, error handling, size and power."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import stats
from protocol.errors import ProtocolError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "stats"  # ../shared/stats of the repo
REF = json.loads((SHARED / "reference.json").read_text())


def load_ref(key: str) -> stats.PairedData:
    with open(SHARED / REF[key]["file"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    return stats.paired_from_long([r["problem"] for r in rows], [int(r["alpha_correct"]) for r in rows],
                                  [int(r["topk_correct"]) for r in rows], [r["gen"] for r in rows])


def exact_bootstrap(D: np.ndarray) -> tuple[np.ndarray, int]:
    """Oracle: the ideal (B = infinity) bootstrap distribution of S* = n-fold convolution of the
    empirical distribution of D. Returns (pmf, offset) with pmf[s + offset] = P(S* = s)."""
    kmax = int(np.abs(D).max())
    base = np.bincount(D + kmax, minlength=2 * kmax + 1) / D.size
    pmf, off, power, poff, n = np.ones(1), 0, base, kmax, D.size
    while n:  # square-and-multiply on distributions
        if n & 1:
            pmf, off = np.convolve(pmf, power), off + poff
        n >>= 1
        if n:
            power, poff = np.convolve(power, power), 2 * poff
    return pmf, off


def exact_quantile(pmf: np.ndarray, off: int, q: float) -> int:
    return int(np.searchsorted(np.cumsum(pmf), q, side="left")) - off


# --------------------------------------------------------------------------------------------------
# reference.json


@pytest.mark.parametrize("key", ["k1", "k4"])
def test_reference_point_estimates(key):
    ref, data = REF[key], load_ref(key)
    res = stats.paired_test(data, boot=1000, seed=1)
    assert (res.n, res.k) == (ref["n_problems"], ref["k_per_arm"])
    assert res.acc_treatment == pytest.approx(ref["acc_treatment"], rel=1e-12)
    assert res.acc_baseline == pytest.approx(ref["acc_baseline"], rel=1e-12)
    assert res.estimate == pytest.approx(ref["mean_paired_difference"], rel=1e-12)
    assert res.se == pytest.approx(ref["clustered_se"], rel=1e-9)
    assert res.p_z == pytest.approx(ref["p_clustered_z"], rel=1e-9)


@pytest.mark.parametrize("key", ["k1", "k4"])
def test_reference_bootstrap_p_within_mc_error(key):
    ref, data = REF[key], load_ref(key)
    res = stats.paired_test(data, boot=100_000, boot_max=100_000, seed=7)
    combined = math.hypot(res.p_bootstrap_mc_se, ref["p_bootstrap_centered_mc_se"])
    assert abs(res.p_bootstrap - ref["p_bootstrap_centered_B1e6"]) <= 3 * combined
    assert res.p_bootstrap_mc_se == pytest.approx(math.sqrt(res.p_bootstrap * (1 - res.p_bootstrap) / 1e5))
    # Independent oracle: the exact ideal-bootstrap p-value.
    pmf, off = exact_bootstrap(data.D)
    s = np.arange(pmf.size) - off
    S = int(data.D.sum())
    p_exact = pmf[np.abs(s - S) >= abs(S)].sum()
    assert abs(res.p_bootstrap - p_exact) <= 3 * res.p_bootstrap_mc_se + 1e-5


@pytest.mark.parametrize("key", ["k1", "k4"])
def test_reference_percentile_cis(key):
    """Percentile CIs at B = 10^6 land on the reference's (and the exact bootstrap's) quantiles up
    to one step of the lattice S/(n k) that the mean difference lives on."""
    ref, data = REF[key], load_ref(key)
    res = stats.paired_test(data, boot=1_000_000, seed=3, m=4)
    step = 1.0 / (data.n * data.k)
    assert res.ci_bonferroni_level == pytest.approx(0.9875)
    for got, want in ((res.ci95, ref["ci95_percentile_B1e6"]),
                      (res.ci_bonferroni, ref["ci98.75_percentile_B1e6"])):
        assert got[0] < res.estimate < got[1]
        assert np.allclose(got, want, atol=step + 1e-12), (got, want)
    pmf, off = exact_bootstrap(data.D)
    for q, got in ((0.025, res.ci95[0]), (0.975, res.ci95[1])):
        assert abs(got - exact_quantile(pmf, off, q) * step) <= step + 1e-12


@pytest.mark.parametrize("key", ["k1", "k4"])
def test_reference_signflip(key):
    ref, data = REF[key], load_ref(key)
    p, method = stats.signflip_pvalue(data.D)
    assert method == "exact"
    mc = math.sqrt(ref["p_signflip_B1e5"] * (1 - ref["p_signflip_B1e5"]) / 1e5)
    assert abs(p - ref["p_signflip_B1e5"]) <= 3 * mc
    # The Monte-Carlo fallback agrees with the exact enumeration.
    p_mc, method = stats.signflip_pvalue(data.D, rng=np.random.default_rng(5), boot=200_000,
                                         exact_limit=0)
    assert method == "mc" and abs(p_mc - p) <= 3 * math.sqrt(p * (1 - p) / 200_000) + 1e-5


def test_reference_mcnemar_k1():
    ref = REF["k1"]["mcnemar"]
    res = stats.paired_test(load_ref("k1"), boot=1000)
    assert {k: res.mcnemar[k] for k in ("n11", "n10", "n01", "n00")} == \
        {k: ref[k] for k in ("n11", "n10", "n01", "n00")}
    assert res.p_mcnemar == pytest.approx(ref["p_exact_scipy_binomtest"], rel=1e-12)
    # For k = 1 the exact sign-flip test is the exact McNemar test.
    assert res.p_signflip == pytest.approx(res.p_mcnemar, rel=1e-9)


def test_reference_toy_case_exactly():
    toy = REF["toy"]
    data = stats.paired_from_sums(toy["D"], k=1)
    res = stats.paired_test(data, boot=2000)
    assert res.estimate == pytest.approx(toy["mean_paired_difference"], abs=1e-15)
    assert res.se == pytest.approx(toy["clustered_se"], rel=1e-12)
    assert res.p_z == pytest.approx(toy["p_clustered_z"], rel=1e-12)
    assert res.p_mcnemar == toy["mcnemar_exact"]  # 2 * 9/256 exactly
    assert (res.mcnemar["n10"], res.mcnemar["n01"]) == (7, 1)


# --------------------------------------------------------------------------------------------------
# identities and cross-checks


def test_clustered_se_equals_statsmodels_cr1():
    import statsmodels.api as sm

    rng = np.random.default_rng(0)
    n, k = 60, 3
    a = rng.integers(0, 2, (n, k))
    b = (rng.random((n, k)) < 0.3 + 0.4 * a.mean(axis=1, keepdims=True)).astype(int)
    data = stats.paired_from_long(np.repeat(np.arange(n), k), a.ravel(), b.ravel())
    fit = sm.OLS((a - b).ravel().astype(float), np.ones(n * k)).fit(
        cov_type="cluster", cov_kwds={"groups": np.repeat(np.arange(n), k)})
    assert stats.clustered_se(data.D, k) == pytest.approx(float(fit.bse[0]), rel=1e-10)
    assert stats.mean_difference(data.D, k) == pytest.approx(float(fit.params[0]), rel=1e-12)


def test_mde_matches_normal_quantiles():
    from scipy.stats import norm

    se = 0.0147
    assert stats.mde(se, 0.05) == pytest.approx((norm.ppf(0.975) + norm.ppf(0.8)) * se, rel=1e-12)
    res = stats.paired_test(load_ref("k4"), m=4, boot=1000)
    assert res.mde == pytest.approx((norm.ppf(1 - 0.0125 / 2) + norm.ppf(0.8)) * res.se, rel=1e-12)


def test_holm_and_bonferroni_match_statsmodels():
    from statsmodels.stats.multitest import multipletests

    p = np.array([0.01, 0.04, 0.03, 0.005, 0.2])
    assert np.allclose(stats.holm(p), multipletests(p, method="holm")[1])
    assert np.allclose(stats.bonferroni(p, 5), multipletests(p, method="bonferroni")[1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=8), st.integers(0, 4))
def test_holm_bounds(p, extra):
    p = np.array(p)
    m = p.size + extra
    adj = stats.holm(p, m)
    assert np.all(adj >= p - 1e-15) and np.all(adj <= stats.bonferroni(p, m) + 1e-15)
    order = np.argsort(p, kind="stable")
    assert np.all(np.diff(adj[order]) >= -1e-15)  # monotone in the order of the raw p-values


def test_bootstrap_counts_match_index_resampling():
    """The multinomial-count bootstrap has the law of plain index resampling: compare its
    p-value with a direct index-resampling implementation and S*'s moments with theory."""
    data = load_ref("k4")
    D, n = data.D, data.n
    rng = np.random.default_rng(11)
    B = 100_000
    idx_sums = np.concatenate([D[rng.integers(0, n, (10_000, n))].sum(axis=1) for _ in range(B // 10_000)])
    S = int(D.sum())
    p_index = (1 + int((np.abs(idx_sums - S) >= abs(S)).sum())) / (B + 1)
    hist = stats.bootstrap_sum_hist(D, B, np.random.default_rng(12), chunk=4096)
    assert hist.sum() == B
    p_counts = stats.centred_bootstrap_p(hist, S)
    se = math.sqrt(2 * p_index * (1 - p_index) / B)
    assert abs(p_counts - p_index) <= 4 * se
    s = np.arange(hist.size) - hist.size // 2
    mean = (hist * s).sum() / B
    var = (hist * (s - mean) ** 2).sum() / B
    assert mean == pytest.approx(S, abs=4 * math.sqrt(n * D.var() / B))
    assert var == pytest.approx(n * D.var(), rel=0.02)


def test_chunking_does_not_change_the_law_and_seed_is_reproducible():
    data = load_ref("k4")
    r1 = stats.paired_test(data, boot=50_000, seed=9)
    r2 = stats.paired_test(data, boot=50_000, seed=9)
    r3 = stats.paired_test(data, boot=50_000, seed=9, chunk=1000)
    assert r1.to_dict() == r2.to_dict()
    assert abs(r1.p_bootstrap - r3.p_bootstrap) <= 4 * r1.p_bootstrap_mc_se


def test_escalation_near_threshold_only():
    data = load_ref("k4")
    far = stats.paired_test(data, alpha=0.05, boot=20_000, boot_max=200_000, seed=1)
    assert not far.boot_escalated and far.boot == 20_000
    # Put the per-cell threshold right at the p-value: the decision needs more resamples.
    near = stats.paired_test(data, alpha=REF["k4"]["p_bootstrap_centered_B1e6"], boot=20_000,
                             boot_max=200_000, seed=1)
    assert near.boot_escalated and near.boot == 200_000 and near.boot_requested == 20_000
    assert near.p_bootstrap_mc_se == pytest.approx(
        math.sqrt(near.p_bootstrap * (1 - near.p_bootstrap) / 200_000))
    off = stats.paired_test(data, alpha=REF["k4"]["p_bootstrap_centered_B1e6"], boot=20_000,
                            boot_max=20_000, seed=1)
    assert not off.boot_escalated


def test_zero_effect_and_degenerate_inputs():
    res = stats.paired_test(stats.paired_from_sums([0] * 10, k=2), boot=500)
    assert res.estimate == 0 and res.se == 0 and res.p_z == 1 and res.p_bootstrap == 1
    assert res.p_signflip == 1 and not res.reject
    with pytest.raises(ProtocolError):
        stats.paired_test(stats.paired_from_sums([1], k=1), boot=10)


def test_holm_exact_with_other_p_and_bound_without():
    data = load_ref("k4")
    bound = stats.paired_test(data, m=4, boot=20_000)
    assert bound.p_holm == bound.p_bonferroni and not bound.holm_exact
    exact = stats.paired_test(data, m=4, boot=20_000, other_p=[0.001, 0.5, 0.9])
    assert exact.holm_exact
    assert exact.p_holm == pytest.approx(max(4 * 0.001, 3 * exact.p_bootstrap))
    with pytest.raises(ProtocolError, match="m-1"):
        stats.paired_test(data, m=4, boot=100, other_p=[0.1])


# --------------------------------------------------------------------------------------------------
# refusals


def test_mcnemar_refused_for_k_above_one():
    data = load_ref("k4")
    with pytest.raises(ProtocolError, match="k = 1"):
        stats.mcnemar_exact(data)
    res = stats.paired_test(data, boot=100)
    assert res.p_mcnemar is None and res.mcnemar is None


def test_unequal_k_refused():
    with pytest.raises(ProtocolError, match="unequal"):
        stats.paired_from_long(["a", "a", "b"], [1, 0, 1], [0, 0, 1])


@pytest.mark.parametrize("bad", [[1, None, 0, 1], [1, float("nan"), 0, 1]])
def test_missing_outcome_refused(bad):
    with pytest.raises(ProtocolError, match="missing"):
        stats.paired_from_long(["a", "a", "b", "b"], bad, [0, 0, 1, 1])


def test_non_binary_and_duplicates_refused():
    with pytest.raises(ProtocolError, match="0/1"):
        stats.paired_from_long(["a", "b"], [2, 0], [0, 1])
    with pytest.raises(ProtocolError, match="duplicated"):
        stats.paired_from_long(["a", "a", "b", "b"], [1, 0, 1, 1], [0, 0, 1, 0], [0, 0, 0, 1])


# --------------------------------------------------------------------------------------------------
# size and power by simulation


def _simulate(rng, n: int, k: int, effect: float, spread: float = 0.3):
    """(n, k) 0/1 outcomes per arm with within-problem correlation: problem difficulty q_i and a
    problem-level treatment effect ±spread/2 of mean zero (plus `effect`), so generations of one
    problem are correlated in the paired difference as well as in each arm."""
    q = rng.uniform(0.3, 0.7, n)[:, None]
    h = spread * rng.choice([-1.0, 1.0], n)[:, None]
    a = (rng.random((n, k)) < np.clip(q + h / 2 + effect, 0, 1)).astype(int)
    b = (rng.random((n, k)) < np.clip(q - h / 2, 0, 1)).astype(int)
    return a, b


def _naive_p(a, b) -> float:
    """z-test that wrongly treats all n*k generation pairs as independent."""
    d = (a - b).ravel().astype(float)
    z = d.mean() / (d.std(ddof=1) / math.sqrt(d.size))
    return math.erfc(abs(z) / math.sqrt(2))


@pytest.mark.slow
def test_size_and_power_by_simulation():
    rng = np.random.default_rng(20240601)
    n, k, reps, B = 200, 4, 1000, 2000
    rejected = naive = 0
    for r in range(reps):
        a, b = _simulate(rng, n, k, 0.0)
        data = stats.PairedData(np.arange(n), a.sum(axis=1), b.sum(axis=1), k)
        res = stats.paired_test(data, boot=B, boot_max=B, seed=r)
        rejected += res.p_bootstrap <= 0.05
        naive += _naive_p(a, b) <= 0.05
    rate, band = rejected / reps, 3.5 * math.sqrt(0.05 * 0.95 / reps)
    assert abs(rate - 0.05) <= band, f"rejection rate {rate} under the null"
    # The simulated correlation matters: ignoring the clusters over-rejects on the same data, so
    # a non-clustered implementation would fail the size check above.
    assert naive / reps > 0.05 + band, f"naive rate {naive / reps}"
    power = 0
    for r in range(200):
        a, b = _simulate(rng, n, k, 0.10)
        data = stats.PairedData(np.arange(n), a.sum(axis=1), b.sum(axis=1), k)
        power += stats.paired_test(data, boot=B, boot_max=B, seed=r).p_bootstrap <= 0.05
    assert power / 200 >= 0.8, f"power {power / 200} at a 10 pp effect"


# --------------------------------------------------------------------------------------------------
# CLI


def _cli(args):
    from retention.cli import main

    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_cli_stats_json_k4():
    res = _cli(["stats", str(SHARED / "paired_k4.csv"), "--treatment", "alpha_correct",
                "--baseline", "topk_correct", "--cluster", "problem", "--boot", "20000", "--seed",
                "4", "--cells", "4", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    for key in ("n", "k", "estimate", "se", "p_z", "p_bootstrap", "p_bootstrap_mc_se", "boot",
                "seed", "ci95", "ci_bonferroni", "p_bonferroni", "p_holm", "p_signflip",
                "p_mcnemar", "mde"):
        assert key in out
    ref = REF["k4"]
    assert (out["n"], out["k"], out["boot"], out["seed"]) == (299, 4, 20000, 4)
    assert out["se"] == pytest.approx(ref["clustered_se"], rel=1e-9)
    assert out["p_mcnemar"] is None
    assert out["p_bonferroni"] == pytest.approx(min(1, 4 * out["p_bootstrap"]))
    assert out["p_holm"] == out["p_bonferroni"] and out["holm_exact"] is False
    assert out["ci_bonferroni_level"] == pytest.approx(0.9875)


def test_cli_stats_table_k1_has_mcnemar():
    res = _cli(["stats", str(SHARED / "paired_k1.csv"), "--treatment", "alpha_correct",
                "--baseline", "topk_correct", "--cluster", "problem", "--sample", "gen",
                "--boot", "5000"])
    assert res.exit_code == 0, res.output
    assert "exact McNemar" in res.output and "0.2185" in res.output
    assert "clustered SE" in res.output and "2.99 pp" in res.output


def test_cli_stats_bad_input(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("problem,t,b\n1,1,0\n1,0,0\n2,1,1\n")
    res = _cli(["stats", str(bad), "--treatment", "t", "--baseline", "b", "--cluster", "problem"])
    assert res.exit_code != 0 and "unequal" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = _cli(["stats", str(bad), "--treatment", "nope", "--baseline", "b", "--cluster", "problem"])
    assert res.exit_code != 0 and "no column" in res.output
    bad.write_text("problem,t,b\n1,1,\n2,1,1\n")
    res = _cli(["stats", str(bad), "--treatment", "t", "--baseline", "b", "--cluster", "problem"])
    assert res.exit_code != 0 and "0/1" in res.output
