"""The allocation math of the allocating routings (PyramidKV, AdaKV), as pure vectorised functions.

Shapes: layers (eviction groups) `L`, rows of a view `B`, KV heads `G`, stored tokens per head `n`
(padded to the longest), `k` the cadence's kept count per (layer, KV head) of a uniform compaction.

An allocation says how many tokens each (layer, row, KV head) keeps, `counts` `[L, B, G]`, with the
same mean as a uniform compaction: every row's counts sum to `L x G x k` over (layer, head), so the
mean stored tokens per (layer, KV head), the project's budget, is what it would be without the
allocation. *Which* tokens a head keeps is the scorer's order, `retention.policy.scoring.base.keep_order`
(protected first, then by score, ties to the lower index, padding last): a head that keeps `c`
tokens keeps the first `c` of that order, so with `c = k` everywhere it keeps exactly what the
scorer's own top-k keeps.

* PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
  Funneling", 2024; `kvpress/presses/pyramidkv_press.py` of kvpress 0.5.5): layer budgets falling
  linearly from the first layer to the last with the mean of the uniform budget (`pyramid_budgets`).
* AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
  Efficient LLM Inference", 2024; `kvpress/presses/adakv_press.py` of kvpress 0.5.5): within a
  layer, one ranking of the scores of all its heads decides which `G x k` tokens stay, after each
  head's best `n_safe` tokens are protected (the safeguard) (`adakv_kept`).

The conventions (rounding, the safeguard's size, the fallback) are the ones the golden vectors in
`retention/data/golden/routing/README.md` document and `retention conformance` checks.
"""

from __future__ import annotations

import torch

from retention.policy.scoring.base import keep_order


def keep_ranks(scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`[..., n]` int64: each token's place in its head's keep order (`keep_order`; 0 is kept first).
    scores, protected, valid: `[..., n]`."""
    order = keep_order(scores, protected, valid)
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def kept_by_counts(ranks: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`[..., n]` bool: the first `counts[...]` tokens of each head's keep order (ranks `[..., n]`,
    counts `[...]`)."""
    return ranks < counts[..., None]


def padded_indices(kept: torch.Tensor, width: int) -> torch.Tensor:
    """`[..., width]` int64: the kept indices of each head ascending, then -1 (kept `[..., n]` bool,
    at most `width` kept per head)."""
    n = kept.shape[-1]
    idx = torch.arange(n, device=kept.device).expand_as(kept)
    ordered = torch.sort(torch.where(kept, idx, n), dim=-1).values[..., :width]
    return ordered.masked_fill(ordered == n, -1)


def pyramid_budgets(n: torch.Tensor, keep: torch.Tensor, layers: int, beta: float,
                    window: torch.Tensor) -> torch.Tensor:
    """PyramidKV's kept count of every layer, `[L, B]` int64, for rows of `n` stored tokens that keep
    `keep` on average with a window of `window` tokens always kept (all `[B]` float64).

    kvpress 0.5.5 (`PyramidKVPress.get_layer_budget`, README section 5): `min = keep / beta`,
    `max = 2 keep - min`, so a linear fall from `max` (layer 0) to `min` (the last layer) has mean
    `keep`; if `max >= n - window`, the top is clipped to `max = n - window` and `min = 2 keep - max`
    (the same mean); unless `n >= max >= min >= window`, every layer keeps `max(1, round(keep))`.
    Layer `l` keeps `round(max - l (max - min) / (L - 1))` (half to even, as Python's `round` and
    `torch.round`). `beta = 1` is the flat pyramid: every layer keeps `keep`.

    Two departures hold the mean budget exactly, and neither changes a golden case: a one-layer model
    keeps `round(keep)` (kvpress keeps `round(max)`, above the mean); and where rounding moves the
    total off `round(L keep)` (in exact arithmetic, layers `l` and `L - 1 - l` sit at `keep +- x`
    and half-to-even rounding keeps their sum, but the float `step` can put one of them just off a
    half: 9 layers, keep 14, beta 1.5 sum to one token short), the residual is taken from (or given
    to) the layers whose rounding moved them most the other way, one token each. A test sweeps the
    parameters; the routing checks every allocation's total."""
    lo = keep / beta
    hi = 2 * keep - lo
    clip = hi >= n - window
    hi = torch.where(clip, n - window, hi)
    lo = torch.where(clip, 2 * keep - hi, lo)
    ok = (n >= hi) & (hi >= lo) & (lo >= window) & (layers > 1)  # [B]: else the uniform fallback
    step = (hi - lo) / max(layers - 1, 1)
    l = torch.arange(layers, dtype=torch.float64, device=n.device)[:, None]
    exact = torch.where(ok, hi - l * step, keep)  # [L, B] before rounding
    budget = torch.where(ok, torch.round(exact), torch.round(keep).clamp(min=1))
    d = torch.where(ok, torch.round(layers * keep) - budget.sum(0), 0.0)  # [B], |d| <= L / 2
    err = (exact - budget) * torch.sign(d)  # > 0: rounding moved this layer against d
    order = torch.sort(err, dim=0, descending=True, stable=True).indices
    place = torch.empty_like(order).scatter_(0, order, l.long().expand_as(order))
    return (budget + torch.sign(d) * (place < d.abs()).double()).long()


def cap_to_stored(targets: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Counts `[L, ...]` int64 as close to `targets` `[L, ...]` as the `stored` tokens `[L, ...]`
    allow, with the same total over the layer axis: a layer keeps at most what it stores, and the
    shortfall goes to the layers with room, the first layers first (in a pyramid, those whose
    budget is largest), each up to what it stores. Needs `stored.sum(0) >= targets.sum(0)`."""
    counts = torch.minimum(targets, stored)
    short = (targets - counts).sum(0)  # [...]
    room = stored - counts
    before = room.cumsum(0) - room  # room in the layers before each
    return counts + (short - before).clamp(min=0).minimum(room)


def safeguard_size(k: int, alpha: float) -> int:
    """AdaKV's per-head safeguard: `int(k alpha)` tokens, at least 1 when `alpha > 0` (README)."""
    n_safe = int(k * alpha)
    return max(1, n_safe) if alpha > 0 else 0


def adakv_kept(scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor, k: int,
               n_safe: int) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaKV's kept tokens and its safeguard, both `[L, B, G, n]` bool (inputs `[L, B, G, n]`).

    Each head's first `n_safe` tokens of its keep order (its protected tokens, then its best scores)
    are safeguarded; then one ranking of every head's scores in the layer (the safeguarded and
    protected tokens first, padding last, ties to the lower `head x n + index`) keeps the best
    `G x k` tokens of the layer, so head `g` keeps `counts[g] >= n_safe` of its own (kvpress prunes
    the complement, the lowest `G (n - k)`). The kept tokens of a head are the first `counts[g]` of
    its keep order, so `kept_by_counts(keep_ranks(...), kept.sum(-1))` gives back `kept`."""
    ranks = keep_ranks(scores, protected, valid)
    safe = (ranks < n_safe) & valid
    s = scores.float().masked_fill(~valid, float("-inf")).masked_fill(protected | safe, float("inf"))
    L, B, G, n = s.shape
    top = torch.sort(s.reshape(L, B, G * n), dim=-1, descending=True, stable=True).indices[..., :G * k]
    kept = torch.zeros(L, B, G * n, dtype=torch.bool, device=s.device).scatter_(-1, top, True)
    return kept.view(L, B, G, n), safe
