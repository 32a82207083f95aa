"""Conformance of the allocating routings (PyramidKV, AdaKV) with kvpress 0.5.5's presses.

The cases (`retention/data/golden/routing/`, README section 5) give the scores kvpress ranked, so
the allocation is checked on its own: `retention.policy.routing.allocation`'s functions, given a case's
scores and parameters, must reproduce the reference's budgets and kept slots exactly (the README
shows no top-k boundary is tied). kvpress's window is no protected set of its own: SnapKV scores
its slots above every other, so the scores keep it; nothing is protected here and every slot is
valid. The checks run through `retention.runs.conformance.check_case` like the scorer cases.
"""

from __future__ import annotations

import torch

from retention.policy.routing.allocation import (adakv_kept, keep_ranks, kept_by_counts, padded_indices, pyramid_budgets,
                                                 safeguard_size)
from retention.runs.conformance_case import CaseResult

ROUTINGS = ("pyramidkv", "adakv")


def _equal(res: CaseResult, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    res.checks.append(what)
    got, want = got.cpu().long(), want.cpu().long()
    if got.shape != want.shape:
        res.fail(f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    elif not torch.equal(got, want):
        res.fail(f"{what}: {int((got != want).sum())} of {got.numel()} entries differ from the reference")


def _open(t: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's scores `[L, 1, G, n]` with nothing protected and every slot valid."""
    scores = t["scores"]
    return scores, torch.zeros_like(scores, dtype=torch.bool), torch.ones_like(scores, dtype=torch.bool)


def check_pyramidkv(p: dict, t: dict, res: CaseResult) -> None:
    """Layer budgets from (n, ratio, window, beta, L) and each head's top-`budget` slots."""
    res.exact = True
    n, w, L = p["n"], p["window_size"], p["num_layers"]
    f64 = lambda x: torch.tensor([float(x)], dtype=torch.float64)  # noqa: E731 - one row
    keep = (w + n * (1 - p["compression_ratio"])) - w  # as kvpress computes it (README: rounding at .5)
    budgets = pyramid_budgets(f64(n), f64(keep), L, float(p["beta"]), f64(w))[:, 0]  # [L]
    _equal(res, "layer_budget", budgets, t["layer_budget"])
    scores, protected, valid = _open(t)
    G = scores.shape[2]
    kept = kept_by_counts(keep_ranks(scores, protected, valid), t["layer_budget"][:, None, None].expand(L, 1, G))
    _equal(res, "keep_mask", kept[:, 0], t["keep_mask"])
    _equal(res, "keep_sorted", padded_indices(kept[:, 0], t["keep_sorted"].shape[-1]), t["keep_sorted"])


def check_adakv(p: dict, t: dict, res: CaseResult) -> None:
    """n_safe from (n_kept, alpha), the safeguard, the per-head counts and the kept slots; and the
    runtime's rule (each head's first `count` slots of its own order) gives the same slots."""
    res.exact = True
    k, alpha = p["n_kept"], p["alpha_safeguard"]
    n_safe = safeguard_size(k, alpha)
    res.checks.append("n_safe")
    if n_safe != p["n_safe"]:
        res.fail(f"n_safe: {n_safe} != reference {p['n_safe']}")
    scores, protected, valid = _open(t)
    kept, safe = adakv_kept(scores, protected, valid, k, n_safe)  # [L, 1, G, n]
    _equal(res, "safeguard_mask", safe[:, 0], t["safeguard_mask"])
    _equal(res, "keep_count", kept.sum(-1)[:, 0], t["keep_count"])
    _equal(res, "keep_mask", kept[:, 0], t["keep_mask"])
    by_count = kept_by_counts(keep_ranks(scores, protected, valid), kept.sum(-1))
    _equal(res, "keep_mask (per-head order)", by_count[:, 0], t["keep_mask"])
    _equal(res, "keep_sorted", padded_indices(kept[:, 0], t["keep_sorted"].shape[-1]), t["keep_sorted"])


CHECKERS = {"pyramidkv": check_pyramidkv, "adakv": check_adakv}
