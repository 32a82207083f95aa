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

from dataclasses import dataclass, field

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
    """Accumulated attention mass + recent window. Parameter: `window` (protected newest tokens, default 8)."""

    _acc: list = field(default_factory=list, init=False, repr=False)  # L x [B, G, n] float32

    def reset(self) -> None:
        self._acc = []

    def accumulate(self, layer: int, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                   scaling: float) -> None:
        """Add the mass from `query` `[B, Hq, q, d]` (the newest `q` stored tokens' queries) to the
        accumulator of `layer`, first extending it with zeros for the tokens stored since last time."""
        while len(self._acc) <= layer:
            self._acc.append(None)
        B, G, n = positions.shape
        acc = self._acc[layer]
        if acc is None:
            acc = torch.zeros(B, G, 0, dtype=torch.float32, device=keys.device)
        if acc.shape[-1] < n:
            acc = torch.cat([acc, acc.new_zeros(B, G, n - acc.shape[-1])], dim=-1)
        # The new tokens are the last q stored; every KV head holds them, at the same positions.
        query_pos = positions[:, 0, n - query.shape[2]:]
        self._acc[layer] = acc + attention_mass(query, keys, positions, query_pos, scaling)

    def observe(self, cache, next_position: int) -> None:
        for i, call in enumerate(self._recorder.take(cache)):
            layer = cache.layers[i]
            self.accumulate(i, call.query, layer.keys, layer.positions, call.scaling)

    def compacted(self, keep: torch.Tensor) -> None:
        """Keep the accumulator aligned with the cache: gather the kept slots (`[L, B, G, k]`)."""
        for i, acc in enumerate(self._acc):
            self._acc[i] = torch.gather(acc, -1, keep[i] if keep.dim() == 4 else keep)

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: accumulated mass, +inf on the `window` newest tokens."""
        if len(self._acc) != view.num_layers:
            raise RuntimeError("h2o: no accumulated attention (scorer used outside attach(), or observe() not called)")
        return torch.stack([acc.masked_fill(view.positions[l] >= view.next_position - self.window, float("inf"))
                            for l, acc in enumerate(self._acc)])
