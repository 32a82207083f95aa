"""Budget semantics: the nominal b each accounting mode derives, and refused configurations."""

import pytest

from retention.policy.cadence.base import Cadence, default_interval, nominal_budget
from retention.errors import RetentionError


def test_nominal_per_mode():
    # mean: the cycle b+1..b+N has mean b + (N+1)/2 <= B
    assert nominal_budget(128, 128, "mean") == 63
    assert nominal_budget(128, 128, "peak") == 0
    assert nominal_budget(128, 128, "prefill") == 128
    for B in (64, 100, 128, 512):
        for N in (1, 2, 7, 32, 64):
            b = nominal_budget(B, N, "mean")
            if b < 1:
                continue
            cycle_mean = b + (N + 1) / 2
            assert cycle_mean <= B < cycle_mean + 1


def test_default_interval_fits_small_budgets():
    assert default_interval(512) == 128
    assert default_interval(64) == 64
    assert Cadence(64, default_interval(64)).nominal == 31


def test_due():
    c = Cadence(budget=100, interval=20, accounting="peak")  # b = 80
    assert not c.due(80, prefill=True) and c.due(81, prefill=True)
    assert not c.due(99, prefill=False) and c.due(100, prefill=False)
    assert not Cadence(None, 1).due(10**6, prefill=False)


@pytest.mark.parametrize("kwargs", [
    dict(budget=0, interval=8), dict(budget=-5, interval=8), dict(budget=64, interval=0),
    dict(budget=64, interval=128), dict(budget=10, interval=4, sink=4, recent=8),
    dict(budget=64, interval=8, accounting="median"),
])
def test_bad_cadence_refused(kwargs):
    with pytest.raises(RetentionError):
        Cadence(**kwargs)


def test_default_interval_works_in_every_accounting_mode_at_every_budget():
    from retention.policy.cadence.base import ACCOUNTING_MODES, largest_interval

    for accounting in ACCOUNTING_MODES:
        for floor in (1, 5, 13):
            for budget in range(floor + 2, 700):
                n = default_interval(budget, accounting, floor)
                cad = Cadence(budget, n, accounting, sink=floor - 1)  # does not raise
                assert cad.nominal >= floor and 1 <= n <= 128
                fits = largest_interval(budget, accounting, floor)
                Cadence(budget, fits, accounting, sink=floor - 1)
                if accounting != "prefill":
                    with pytest.raises(RetentionError):
                        Cadence(budget, fits + 1, accounting, sink=floor - 1)
    assert default_interval(64, "peak") == 32 and default_interval(512, "peak") == 128
    assert default_interval(64, "peak", floor=40) == 24  # capped so that b >= sink + recent + 1


def test_impossible_interval_names_the_largest_that_works():
    with pytest.raises(RetentionError, match="largest --interval that works here is 60"):
        Cadence(64, 64, "peak", sink=3)
    with pytest.raises(RetentionError, match="no interval works"):
        Cadence(4, 1, "peak", sink=3)
