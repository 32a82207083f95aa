"""Power before a plan is registered: each cell's minimum detectable effect from the dev runs.

A confirmation that cannot detect the effect it is run for ends "no significant difference" on a
handful of discordant pairs; this module says so before the confirm split is touched.

The unit is the paired per-sample difference `d_ij = t_ij - b_ij` in {-1, 0, 1} of problem `i`,
sample `j` (treatment and baseline correct or not). The confirm test (`protocol.stats.paired_test`)
is on the mean of the per-problem means `m_i = mean_j d_ij`, clustered by problem, so its standard
error over `n` problems of `k` samples is `sqrt((sigma_b^2 + sigma_w^2 / k) / n)` with

* `sigma_w^2`, the within-problem variance of `d` (the mean over problems of the sample variance
  over their `k_dev` samples, ddof 1), and
* `sigma_b^2 = max(V - sigma_w^2 / k_dev, 0)`, the between-problem variance, `V` the variance of
  the dev problems' means (ddof 1): the one-way ANOVA estimator.

With one dev sample per problem the two cannot be told apart, and the whole of `V` is taken as
between-problem variance (it then does not shrink with the confirmation's `k`): conservative.

The minimum detectable effect at the plan's per-cell level (`alpha / m`, Bonferroni over the plan's
`m` cells, two-sided) and power `1 - beta` is `(z_{1 - alpha/(2m)} + z_{1-beta}) * SE`
(`protocol.stats.mde`). Beside it: the dev discordance (share of pairs whose verdicts differ) and
the discordant pairs it predicts at the confirmation's `n * k`.

Shapes: `d` is `(n, k)` int.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from protocol import stats
from protocol.errors import ProtocolError
from protocol.runs import Run, correct

DEFAULT_POWER = 0.8
# A plan whose MDE is above this (percentage points) is refused without --allow-underpowered.
DEFAULT_MDE_BOUND_PP = 10.0


@dataclass(frozen=True)
class CellPower:
    """One cell's power figures, as the plan records them (`asdict`)."""

    dev_treatment_run: str
    dev_baseline_run: str
    dev_problems: int
    dev_samples: int
    dev_delta_pp: float
    dev_discordance: float  # share of (problem, sample) pairs with different verdicts
    sigma_between: float
    sigma_within: float
    n: int
    k: int
    alpha_cell: float
    power: float
    se_pp: float | None
    mde_pp: float | None  # None: no discordant dev pair, so no variance to size the confirmation from
    expected_discordant: float  # discordant pairs expected at n * k

    def line(self) -> str:
        mde = "undefined (no discordant dev pair)" if self.mde_pp is None else f"{self.mde_pp:.1f} pp"
        return (f"MDE {mde} at n={self.n}, k={self.k}, alpha/m={self.alpha_cell:.4g}, power "
                f"{self.power:.2f} (SE {self.se_pp:.2f} pp; dev: {self.dev_problems} problems x {self.dev_samples}, "
                f"delta {self.dev_delta_pp:+.1f} pp, discordance {100 * self.dev_discordance:.1f}% -> "
                f"{self.expected_discordant:.0f} discordant pairs expected)")


def paired_matrix(treatment: Run, baseline: Run) -> np.ndarray:
    """`(n, k)` int8 per-sample differences of two paired dev runs, problems sorted, samples in order;
    refused unless every problem has the same samples in both."""
    kt = {(str(r["problem_id"]), int(r["sample"])): correct(r) for r in treatment.records}
    kb = {(str(r["problem_id"]), int(r["sample"])): correct(r) for r in baseline.records}
    if not kt or kt.keys() != kb.keys():
        raise ProtocolError(f"dev runs {treatment.run_id} and {baseline.run_id} are not paired record for record")
    problems = sorted({p for p, _ in kt})
    samples = sorted({s for _, s in kt})
    if len(kt) != len(problems) * len(samples):
        raise ProtocolError(f"dev runs {treatment.run_id}: problems with different numbers of samples")
    return np.array([[kt[p, s] - kb[p, s] for s in samples] for p in problems], dtype=np.int8)


def variance_components(d: np.ndarray) -> tuple[float, float]:
    """(sigma_b^2, sigma_w^2) of `(n, k)` differences (module doc; k = 1: all of it between)."""
    d = np.asarray(d, dtype=float)
    n, k = d.shape
    if n < 2:
        raise ProtocolError("power needs at least 2 dev problems")
    v = float(d.mean(axis=1).var(ddof=1))
    if k < 2:
        return v, 0.0
    w = float(d.var(axis=1, ddof=1).mean())
    return max(v - w / k, 0.0), w


def cell_power(d: np.ndarray, n: int, k: int, alpha: float, m: int, power: float = DEFAULT_POWER,
               runs: tuple[str, str] = ("", "")) -> CellPower:
    """The power figures of a cell confirmed on `n` problems x `k` samples at `alpha` over `m` cells,
    from its dev differences `d` `(n_dev, k_dev)`."""
    if n < 2 or k < 1 or m < 1 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ProtocolError(f"power needs n >= 2, k >= 1, m >= 1, alpha and power in (0, 1); got n={n}, k={k}, "
                            f"m={m}, alpha={alpha}, power={power}")
    between, within = variance_components(d)
    se = math.sqrt((between + within / k) / n)
    disc = float((np.asarray(d) != 0).mean())
    if disc == 0:  # a zero SE is no evidence of a small one: the dev runs never disagreed
        se = None
    return CellPower(dev_treatment_run=runs[0], dev_baseline_run=runs[1], dev_problems=int(d.shape[0]),
                     dev_samples=int(d.shape[1]), dev_delta_pp=100 * float(np.mean(d)), dev_discordance=disc,
                     sigma_between=math.sqrt(between), sigma_within=math.sqrt(within), n=int(n), k=int(k),
                     alpha_cell=alpha / m, power=power, se_pp=None if se is None else 100 * se,
                     mde_pp=None if se is None else 100 * stats.mde(se, alpha / m, power),
                     expected_discordant=disc * n * k)


def underpowered(cells: dict[str, CellPower], bound_pp: float) -> list[str]:
    """The cells whose MDE is above `bound_pp` (or undefined)."""
    return [c for c, p in cells.items() if p.mde_pp is None or not p.mde_pp <= bound_pp]


def power_record(cells: dict[str, CellPower], bound_pp: float, allowed: bool, wall: dict | None = None) -> dict:
    """What a plan records under "power": the bound, whether an MDE above it was allowed (the user's
    flag), each cell's figures and, when measured, the predicted wall time of the confirmation."""
    out = {"mde_bound_pp": float(bound_pp), "allow_underpowered": bool(allowed),
           "cells": {c: asdict(p) for c, p in cells.items()}}
    if wall is not None:
        out["wall_time"] = wall
    return out


def power_lines(plan: dict) -> list[str]:
    """What preregister prints of the plan's power record (none: says how to get it)."""
    power = plan.get("power")
    if power is None:
        return ["  power: not computed (give the dev runs with --dev, and --time-slots for the time)"]
    out = []
    for cid, c in power["cells"].items():
        above = c["mde_pp"] is None or not c["mde_pp"] <= power["mde_bound_pp"]
        flag = f"  <- above the bound of {power['mde_bound_pp']:g} pp, allowed" if above else ""
        out.append(f"  power {cid}: {CellPower(**c).line()}{flag}")
    wall = power.get("wall_time")
    if wall:
        per = ", ".join(f"{cid} {s / 3600:.2f} h" for cid, s in wall["cells_seconds"].items())
        out.append(f"  predicted confirm wall time on {wall['host']} at {wall['slots']} slots: "
                   f"{wall['total_seconds'] / 3600:.2f} h ({per}; {wall['pessimistic']})")
    return out
