"""`h2o`: Heavy-Hitter Oracle, accumulated attention mass plus a recent window.

Shapes: layers `L`, batch `B`, KV heads `G`, query heads `Hq = G * r`, new tokens `q`, stored `n`.

After every forward (prefill included), `observe` takes the queries the model just computed
(`retention.runtime.capture`) and adds, for every stored token of every (layer, KV head), the attention
probability it received from them: softmax over the stored keys (causal by absolute position, the
model's attention scale, float32), summed over the new queries and over the `r` query heads of the
group. The per-token accumulator `[B, G, n]` per layer grows with the cache and follows every
compaction through `compacted(keep)`, so a token's score is the total attention mass it received
while stored (a new token starts with the mass of its own queries, its self-attention included).

On a reference layout model (`retention.models.arch`: MLA, CLA, cross-layer paths) the modules report the
probabilities they computed through the cache (`RetentionCache.note_attention`: on a latent, the
absorbed queries against the latent, which equal the materialised ones), summed over the eviction
group's layers and query heads; `observe` adds them to the same per-token accumulator, per eviction
group, in the model's dtype (`reads`: queries and keys, or the attention).

Selection, as the reference (FMInference/H2O `H2OKVCache_LayerWise`) does it: the budget is split
evenly, the `recent = b - b // 2` newest stored tokens are always kept and the `b // 2` heavy
hitters are the top accumulated mass among all other stored tokens (the tokens just leaving the
recent part compete too); per (layer, KV head). `window=R` fixes the recent part at `R` tokens
instead (protected through `min_recent`, like the other window scorers).
"""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass

import torch

from retention.runtime.cache import CacheView
from retention.policy.scoring.base import WindowScorer, topk_keep

# Queries per block when a long prefill is scored: bounds the [B, G, r, q, n] probability tensor.
QUERY_BLOCK = 256


def attention_mass(query: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor,
                   scaling: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probability each stored key receives from the queries, summed over queries and the
    group's query heads.

    query `[B, Hq, q, d]`, keys `[B, G, n, d]`, key_pos `[B, G, n]`, query_pos `[B, q]`, valid
    `[B, G, n]` bool or None (False on padding) -> `[B, G, n]` f32 (0 on padding).
    Key `j` is visible to query `i` iff it is valid and `key_pos[j] <= query_pos[i]` (causal).
    """
    B, G, n, d = keys.shape
    Hq, q_len = query.shape[1], query.shape[2]
    k = keys.float()
    total = torch.zeros(B, G, n, dtype=torch.float32, device=keys.device)
    for s in range(0, q_len, QUERY_BLOCK):
        q = query[:, :, s:s + QUERY_BLOCK].float().reshape(B, G, Hq // G, -1, d)
        logits = torch.einsum("bgrqd,bgnd->bgrqn", q, k) * scaling
        visible = key_pos[:, :, None, None, :] <= query_pos[:, None, None, s:s + QUERY_BLOCK, None]
        if valid is not None:
            visible = visible & valid[:, :, None, None, :]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num_(0.0)
        total += probs.sum(dim=(2, 3))
    return total


def split_budget(k: int) -> tuple[int, int]:
    """The reference's even split of a budget of `k` kept tokens: (heavy `k // 2`, recent `k - k // 2`)."""
    return k // 2, k - k // 2


def recent_mask(valid: torch.Tensor, recent: int) -> torch.Tensor:
    """`[..., n]` bool: the last `recent` valid slots of each row (the newest tokens, since the cache
    is stored in position order and padding follows the stored slots)."""
    after = valid.flip(-1).to(torch.int64).cumsum(-1).flip(-1)  # valid slots at or after j
    return valid & (after <= recent)


def heavy_recent_keep(mass: torch.Tensor, valid: torch.Tensor, protected: torch.Tensor, heavy: int,
                      recent: int) -> torch.Tensor:
    """H2O's kept slots: the `recent` newest plus the `heavy` largest accumulated `mass` among the rest.

    mass, valid, protected (extra tokens forced in, e.g. sinks; counted inside `heavy + recent`):
    `[..., n]`. Returns `[..., min(heavy + recent, n)]` int64 ascending; padding is never kept.
    """
    k = min(heavy + recent, mass.shape[-1])
    scores = mass.float().masked_fill(~valid, float("-inf"))
    return topk_keep(scores, (protected | recent_mask(valid, recent)) & valid, k)


@dataclass
class H2O(WindowScorer):
    """Heavy hitters + recent tokens. Parameter: `window` (recent tokens; default None: half the
    kept budget, the reference's split).

    The accumulator is per-token state stored in the cache itself (`RetentionCache.add_extra`,
    `[S, G, cap]` float32 per layer), so it follows every compaction, row move and slot refill
    exactly like the keys, and a new token's entry starts at zero."""

    name: ClassVar[str] = "h2o"

    EXTRA = "h2o_mass"
    reads = (frozenset({"queries", "keys"}), frozenset({"attention"}))
    window: int | None = None

    def __post_init__(self):
        if self.window is not None:
            super().__post_init__()

    def min_recent(self) -> int:
        """An explicit `window` is protected by the cadence; the default even split is applied in
        `select`, where the budget is known."""
        return self.window or 0

    def observe(self, cache, next_position: list[int]) -> None:
        if cache.collect_attention:  # a layout model: the mass its modules reported, per group
            for g, mass in enumerate(cache.attention):  # [R, G, q, w]
                acc = cache.add_extra(g, self.EXTRA, dtype=mass.dtype)
                acc[:, :, :mass.shape[-1]] += mass.sum(2)
            return
        valid = cache.valid_mask()  # [R, w]
        for i, call in enumerate(self._recorder.take(cache)):
            layer = cache.layers[i]
            acc = cache.add_extra(i, self.EXTRA)
            w = layer.keys.shape[2]
            q = call.query.shape[2]
            # The new tokens are the last q stored of each row; every KV head holds them.
            ends = torch.tensor(cache.lengths, device=layer.positions.device)
            idx = (ends[:, None] - q + torch.arange(q, device=ends.device)[None]).clamp(min=0)
            query_pos = torch.gather(layer.positions[:, 0], 1, idx)
            key_valid = valid[:, None, :].expand_as(layer.positions)
            acc[:, :, :w] += attention_mass(call.query, cache.layer_keys(i), layer.positions, query_pos, call.scaling,
                                            key_valid)

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: the accumulated attention mass, -inf on padding (the recent part is forced
        in by `select`)."""
        if not view.extra or self.EXTRA not in view.extra[0]:
            raise RuntimeError("h2o: no accumulated attention (scorer used outside attach(), or observe() not called)")
        return torch.stack([view.extra[l][self.EXTRA].masked_fill(~view.valid[l], float("-inf"))
                            for l in range(view.num_layers)])

    def select(self, scores: torch.Tensor, view: CacheView, k: int) -> torch.Tensor:
        """`[L, B, G, k]`: the recent part (`window`, or `k - k // 2`) plus the heaviest of the rest."""
        heavy, recent = split_budget(k) if self.window is None else (k - self.window, self.window)
        return heavy_recent_keep(scores, torch.stack(view.valid), torch.stack(view.protected), heavy, recent)
