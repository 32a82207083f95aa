"""protocol.power: the variance components, the MDE and its power, against independent computations.

The MDE is checked three ways: its variance components against a loop over problems with the
standard library's `statistics`, its formula against `NormalDist` directly, and its meaning by
simulation: confirmations drawn at an effect equal to the MDE reject at about the stated power.
"""

import math
import statistics
from statistics import NormalDist

import numpy as np
import pytest

from protocol.errors import ProtocolError
from protocol.power import (cell_power, paired_matrix, power_lines, power_record, underpowered,
                            variance_components)
from protocol.runs import Run


def components_by_hand(d):
    rows = [list(map(float, r)) for r in d]
    k = len(rows[0])
    v = statistics.variance([sum(r) / k for r in rows])
    if k == 1:
        return v, 0.0
    w = sum(statistics.variance(r) for r in rows) / len(rows)
    return max(v - w / k, 0.0), w


def test_components_match_a_loop_over_problems():
    rng = np.random.default_rng(1)
    for k in (1, 2, 4):
        d = rng.choice([-1, 0, 0, 1], size=(50, k)).astype(np.int8)
        got = variance_components(d)
        want = components_by_hand(d)
        assert got == pytest.approx(want, abs=1e-12)


def test_mde_is_the_normal_formula_at_the_cells_level():
    d = np.array([[1, 0], [0, 0], [-1, 1], [0, -1], [1, 1], [0, 0]], dtype=np.int8)
    p = cell_power(d, n=299, k=4, alpha=0.05, m=2, power=0.8)
    between, within = components_by_hand(d)
    se = math.sqrt((between + within / 4) / 299)
    z = NormalDist().inv_cdf(1 - 0.05 / 4) + NormalDist().inv_cdf(0.8)
    assert p.mde_pp == pytest.approx(100 * z * se, rel=1e-12)
    assert p.alpha_cell == 0.025 and p.dev_discordance == pytest.approx(6 / 12)
    assert p.expected_discordant == pytest.approx(0.5 * 299 * 4)
    assert p.dev_delta_pp == pytest.approx(100 * 2 / 12)
    assert "MDE" in p.line() and "discordant" in p.line()


def _simulate(q10, q01, n, k, rng, reps):
    """`reps` confirmations of n problems (drawn from the types) x k samples: z statistics of the mean."""
    types = rng.integers(0, len(q10), size=(reps, n))
    u = rng.random((reps, n, k))
    a, b = np.asarray(q10)[types][..., None], np.asarray(q01)[types][..., None]
    d = (u < a).astype(float) - ((u >= a) & (u < a + b)).astype(float)
    m = d.mean(axis=2)
    se = m.std(axis=1, ddof=1) / math.sqrt(n)
    return m.mean(axis=1) / se


def test_a_confirmation_at_the_mde_rejects_at_about_the_stated_power():
    rng = np.random.default_rng(7)
    # Two kinds of problem whose differences go opposite ways (between-problem variance) and
    # discordant samples within each (within-problem variance); no effect on average.
    q10, q01 = [0.30, 0.05], [0.05, 0.30]
    types = rng.integers(0, 2, 4000)
    u = rng.random((4000, 2))
    a, b = np.asarray(q10)[types][:, None], np.asarray(q01)[types][:, None]
    d = ((u < a).astype(int) - ((u >= a) & (u < a + b)).astype(int)).astype(np.int8)
    n, k, alpha, m = 299, 2, 0.05, 2
    p = cell_power(d, n=n, k=k, alpha=alpha, m=m, power=0.8)
    delta = p.mde_pp / 100
    shifted10, shifted01 = [x + delta / 2 for x in q10], [x - delta / 2 for x in q01]
    z = _simulate(shifted10, shifted01, n, k, rng, 4000)
    crit = NormalDist().inv_cdf(1 - alpha / (2 * m))
    assert np.mean(np.abs(z) > crit) == pytest.approx(0.8, abs=0.04)
    # and at half the MDE a confirmation mostly misses it
    half = _simulate([x + delta / 4 for x in q10], [x - delta / 4 for x in q01], n, k, rng, 4000)
    assert np.mean(np.abs(half) > crit) < 0.45


def test_one_dev_sample_takes_all_variance_as_between_problems():
    d = np.array([[1], [0], [-1], [0], [1], [0]], dtype=np.int8)
    p1, p8 = cell_power(d, n=100, k=1, alpha=0.05, m=1), cell_power(d, n=100, k=8, alpha=0.05, m=1)
    assert p1.mde_pp == p8.mde_pp and p1.sigma_within == 0.0  # conservative: k does not shrink it


def test_refusals_and_the_record():
    with pytest.raises(ProtocolError, match="at least 2 dev problems"):
        variance_components(np.zeros((1, 2)))
    with pytest.raises(ProtocolError, match="power needs"):
        cell_power(np.zeros((4, 2)), n=1, k=2, alpha=0.05, m=1)
    d = np.array([[1, 0], [0, -1], [1, 1], [0, 0]], dtype=np.int8)
    cells = {"a": cell_power(d, 299, 2, 0.05, 2), "b": cell_power(d, 20, 1, 0.05, 2)}
    assert underpowered(cells, bound_pp=cells["a"].mde_pp + 0.01) == ["b"]
    rec = power_record(cells, 10.0, True, {"host": "h", "slots": 4, "pessimistic": "x", "cells_seconds": {"a": 7200.0},
                                           "total_seconds": 7200.0})
    assert rec["allow_underpowered"] is True and set(rec["cells"]) == {"a", "b"}
    lines = power_lines({"power": rec})
    assert len(lines) == 3 and "above the bound of 10 pp, allowed" in lines[1] and "2.00 h" in lines[2]
    assert "not computed" in power_lines({})[0]


def _run(verdicts, run_id):
    recs = [{"problem_id": p, "sample": s, "verdict": v} for (p, s), v in verdicts.items()]
    return Run(path=None, meta={"run_id": run_id}, config={"split": "dev"}, records=recs)


def test_paired_matrix_pairs_record_for_record():
    t = _run({("p1", 0): True, ("p1", 1): False, ("p2", 0): True, ("p2", 1): True}, "t")
    b = _run({("p1", 0): False, ("p1", 1): False, ("p2", 0): True, ("p2", 1): False}, "b")
    assert paired_matrix(t, b).tolist() == [[1, 0], [0, 1]]
    with pytest.raises(ProtocolError, match="not paired"):
        paired_matrix(t, _run({("p1", 0): True}, "c"))
