"""`h2o`: Heavy-Hitter Oracle, accumulated attention mass plus a recent window.

Shapes: layers `L`, batch `B`, KV heads `G`, query heads `Hq = G * r`, new tokens `q`, stored `n`.

After every forward (prefill included), `observe` takes the queries the model just computed
(`retention.capture`) and adds, for every stored token of every (layer, KV head), the attention
probability it received from them: softmax over the stored keys (causal by absolute position, the
model's attention scale, float32), summed over the new queries and over the `r` query heads of the
group. The per-token accumulator `[B, G, n]` per layer grows with the cache and follows every
compaction through `compacted(keep)`, so a token's score is the total attention mass it received
while stored. Selection: top-`(b - w)` by accumulated mass per (layer, KV head), plus the `window`
newest tokens (default 8, protected through `min_recent` and scored +inf).

The original H2O (Zhang et al. 2023) splits its budget evenly between heavy hitters and recent
tokens; here the recent part is the `window` option, like the other window-based scorers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retention.cache import CacheView
from retention.scorers import register
from retention.scorers.base import WindowScorer

# Queries per block when a long prefill is scored: bounds the [B, G, r, q, n] probability tensor.
QUERY_BLOCK = 256


def attention_mass(query: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """Attention probability each stored key receives from the queries, summed over queries and the
    group's query heads.

    query `[B, Hq, q, d]`, keys `[B, G, n, d]`, key_pos `[B, G, n]`, query_pos `[B, q]` -> `[B, G, n]` f32.
    Key `j` is visible to query `i` iff `key_pos[j] <= query_pos[i]` (causal).
    """
    B, G, n, d = keys.shape
    Hq, q_len = query.shape[1], query.shape[2]
    k = keys.float()
    total = torch.zeros(B, G, n, dtype=torch.float32, device=keys.device)
    for s in range(0, q_len, QUERY_BLOCK):
        q = query[:, :, s:s + QUERY_BLOCK].float().reshape(B, G, Hq // G, -1, d)
        logits = torch.einsum("bgrqd,bgnd->bgrqn", q, k) * scaling
        visible = key_pos[:, :, None, None, :] <= query_pos[:, None, None, s:s + QUERY_BLOCK, None]
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        total += probs.sum(dim=(2, 3))
    return total


@register("h2o")
@dataclass
class H2O(WindowScorer):
    """Accumulated attention mass + recent window. Parameter: `window` (protected newest tokens, default 8).

    The accumulator is per-token state stored in the cache itself (`RetentionCache.add_extra`,
    `[S, G, cap]` float32 per layer), so it follows every compaction, row move and slot refill
    exactly like the keys, and a new token's entry starts at zero."""

    EXTRA = "h2o_mass"

    def observe(self, cache, next_position: list[int]) -> None:
        valid = cache.valid_mask()  # [R, w]
        for i, call in enumerate(self._recorder.take(cache)):
            layer = cache.layers[i]
            acc = cache.add_extra(i, self.EXTRA)
            w = layer.keys.shape[2]
            q = call.query.shape[2]
            # Padding must receive no mass: give it a position no query can see.
            key_pos = layer.positions.masked_fill(~valid[:, None, :], torch.iinfo(torch.long).max)
            # The new tokens are the last q stored of each row; every KV head holds them.
            ends = torch.tensor(cache.lengths, device=key_pos.device)
            idx = (ends[:, None] - q + torch.arange(q, device=key_pos.device)[None]).clamp(min=0)
            query_pos = torch.gather(layer.positions[:, 0], 1, idx)
            acc[:, :, :w] += attention_mass(call.query, layer.keys, key_pos, query_pos, call.scaling)

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: accumulated mass, +inf on the `window` newest tokens, -inf on padding."""
        if not view.extra or self.EXTRA not in view.extra[0]:
            raise RuntimeError("h2o: no accumulated attention (scorer used outside attach(), or observe() not called)")
        recent = view.next_position[:, None, None] - self.window
        return torch.stack([view.extra[l][self.EXTRA].masked_fill(view.positions[l] >= recent, float("inf"))
                            .masked_fill(~view.valid[l], float("-inf")) for l in range(view.num_layers)])
