"""The exploratory paired test on the fidelity proxy (per-record mean KL, first divergence step)."""

from types import SimpleNamespace

import numpy as np
import pytest

from protocol.report_fidelity import cluster_bootstrap, fidelity_comparisons, per_problem_differences, summary_lines


def rec(pid, s, kl, first, steps=50):
    return {"problem_id": pid, "sample": s, "fidelity": {"kl_mean": kl, "first_divergence_step": first, "steps": steps}}


def test_per_problem_mean_of_paired_differences_and_censoring():
    t = [rec("a", 0, 0.1, 5), rec("a", 1, 0.3, None), rec("b", 0, 0.2, 7), rec("c", 0, 0.9, 1)]
    b = [rec("a", 0, 0.2, 4), rec("a", 1, 0.2, 10), rec("b", 0, 0.4, 7), {"problem_id": "c", "sample": 0}]
    ids, d = per_problem_differences(t, b, "kl_mean")
    assert ids == ["a", "b"]  # c: the baseline record has no fidelity figures
    np.testing.assert_allclose(d, [((0.1 - 0.2) + (0.3 - 0.2)) / 2, 0.2 - 0.4])
    _, d = per_problem_differences(t, b, "first_divergence_step")
    np.testing.assert_allclose(d, [((5 - 4) + (50 - 10)) / 2, 0.0])  # never diverged: counts its 50 steps


def test_bootstrap_finds_a_consistent_difference_and_not_a_null_one():
    rng = np.random.default_rng(0)
    shift = cluster_bootstrap(-0.05 + 0.01 * rng.standard_normal(40), boot=5000, seed=1)
    assert shift["p_bootstrap"] < 0.001 and shift["ci95_hi"] < 0 < -shift["ci95_lo"]
    assert shift["ci95_lo"] <= shift["estimate"] <= shift["ci95_hi"]
    null = cluster_bootstrap(0.01 * rng.standard_normal(40), boot=5000, seed=1)
    assert null["p_bootstrap"] > 0.05 and null["ci95_lo"] < 0 < null["ci95_hi"]
    assert cluster_bootstrap(np.zeros(5), boot=100, seed=0)["p_bootstrap"] == 1.0
    a, b = (cluster_bootstrap(-0.05 + 0.01 * np.arange(9), boot=2000, seed=3) for _ in range(2))
    assert a == b  # seeded


def test_comparison_rows_are_labelled_exploratory():
    t = SimpleNamespace(model="m", budget=64, label="alpha", records=[rec(str(i), 0, 0.1, 9) for i in range(6)])
    b = SimpleNamespace(model="m", budget=64, label="tri", records=[rec(str(i), 0, 0.2 + 0.01 * i, 5) for i in range(6)])
    rows = fidelity_comparisons([(t, b)], boot=2000, seed=0)
    assert [r["metric"] for r in rows] == ["kl_mean", "first_divergence_step"]
    assert rows[0]["estimate"] == pytest.approx(-0.125) and rows[1]["estimate"] == pytest.approx(4.0)
    assert all("exploratory" in r["endpoint"] for r in rows)
    lines = summary_lines(rows)
    assert len(lines) == 2 and "exploratory" in lines[0] and "alpha vs tri" in lines[0]
    none = SimpleNamespace(model="m", budget=64, label="x", records=[{"problem_id": "0", "sample": 0}])
    assert fidelity_comparisons([(none, b)], boot=10) == []


def test_the_noise_floor_is_measured_on_never_compacted_records():
    from protocol.report_fidelity import floor_lines, floor_text, noise_floor

    recs = [{"compactions": 0, "fidelity": {"kl_mean": 2e-4, "first_divergence_step": 31, "steps": 64}},
            {"compactions": 0, "fidelity": {"kl_mean": 0.0, "first_divergence_step": None, "steps": 64}},
            {"compactions": 3, "fidelity": {"kl_mean": 0.5, "first_divergence_step": 2, "steps": 64}},
            {"compactions": 0}]  # no fidelity figures: not counted
    f = noise_floor(recs)
    assert f == {"floor_records": 2, "floor_kl_mean": 1e-4, "floor_diverged": 1, "floor_first_divergence": 31}
    assert floor_text(f) == ("noise floor (2 never-compacted record(s)): KL 0.0001, 1 of 2 diverged from the "
                             "full cache (earliest at step 31)")
    assert "not measured" in floor_text(noise_floor(recs[2:]))
    arm = {"label": "alpha", "model": "m", "budget": 128, "kl_mean": 0.25, "first_divergence_median": 16,
           "fidelity_records": 3, **f}
    assert floor_lines([arm, dict(arm, fidelity_records=0)]) == [
        "fidelity of alpha (m/128): KL 0.25, first divergence median 16; " + floor_text(f)]
