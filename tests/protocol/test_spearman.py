"""The proxy-drift diagnostic's Spearman p: exact for few configurations (the t approximation gives
three points in the same order p = 0), scipy's otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.diagnostics import EXACT_SPEARMAN_MAX_N, spearman


def test_three_points_in_order_are_one_ordering_in_three():
    rho, p = spearman([0.1, 0.2, 0.3], [5.0, 7.0, 9.0])
    assert rho == pytest.approx(1.0) and p == pytest.approx(2 / 6)  # the identity and its reverse


def test_exact_p_counts_orderings_at_least_as_extreme():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    y = [2.0, 1.0, 4.0, 3.0, 5.0]
    rho, p = spearman(x, y)
    import itertools

    ry = np.array(y)
    count = 0
    for perm in itertools.permutations(range(5)):
        r = np.corrcoef(x, ry[list(perm)])[0, 1]  # ranks: x and y are already ranks here
        count += abs(r) >= abs(rho) - 1e-12
    assert p == pytest.approx(count / 120)


def test_many_points_use_scipy():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=EXACT_SPEARMAN_MAX_N + 4), rng.normal(size=EXACT_SPEARMAN_MAX_N + 4)
    assert spearman(x, y) == pytest.approx(tuple(float(v) for v in spearmanr(x, y)))
