"""A cache that stores exactly the `Store`s of a `CacheLayout` and evicts per sharing group.

Shapes: batch `B`, a store's heads `h`, stored tokens `n`, its per-head width `d`; `G` is the
layout's eviction heads (`kv_heads`: 1 for an MLA latent, so a token is kept or dropped whole).

Every store of a sharing group holds the same tokens in the same order, with one position tensor
`[B, G, n]` per group: a compaction gathers all of the group's stores with the group's kept
indices, so a token a sharing layer evicted is gone for every layer that reads it. Eviction is a
gather into new tensors (memory really shrinks), as in `retention.cache.RetentionLayer.compact`.
"""

from __future__ import annotations

import torch

from retention.layouts import CacheLayout


class LayoutCache:
    """Stored tensors `[B, h, n, d]` by store name, positions `[B, G, n]` by sharing group."""

    def __init__(self, layout: CacheLayout):
        self.layout = layout
        self.groups = layout.groups()
        self.group_of_layer = {layer: g for g, members in enumerate(self.groups) for layer in members}
        self.group_of_store = {s.name: self.group_of_layer[s.writer] for s in layout.stores}
        self.tensors: dict[str, torch.Tensor] = {}
        self.positions: list[torch.Tensor | None] = [None] * len(self.groups)
        # Called as observer(layer, probs [B, G, q, n]) through `note_attention` (attention-based scorers).
        self.observer = None
        # Per-forward values handed between the layers of a path (never cached memory).
        self.scratch: dict = {}

    def begin_step(self, position_ids: torch.Tensor) -> None:
        """Record the absolute positions `[B, q]` of the tokens the coming forward appends."""
        self.scratch = {}
        g = self.layout.kv_heads
        new = position_ids[:, None, :].expand(-1, g, -1)
        self.positions = [new if p is None else torch.cat([p, new], -1) for p in self.positions]

    def append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Append `x` `[B, h, q, d]` to store `name`; return everything it holds `[B, h, n, d]`."""
        old = self.tensors.get(name)
        self.tensors[name] = x if old is None else torch.cat([old, x], 2)
        return self.tensors[name]

    def note_attention(self, layer: int, probs: torch.Tensor) -> None:
        """Hand `layer`'s attention probabilities `[B, X, r, q, n]` (X groups of r query heads) to
        the observer, summed to the cache's eviction heads: `[B, G, q, n]`."""
        if self.observer is None:
            return
        summed = probs.sum(2)
        b, x, q, n = summed.shape
        g = self.layout.kv_heads
        self.observer(layer, summed if x == g else summed.view(b, g, x // g, q, n).sum(2))

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Absolute positions `[B, G, n]` of what `layer` attends to."""
        return self.positions[self.group_of_layer[layer]]

    def stored_lengths(self) -> list[int]:
        """Stored tokens per layer (the length of its sharing group)."""
        return [int(self.layer_positions(i).shape[-1]) if self.positions[0] is not None else 0
                for i in range(self.layout.layers)]

    def compact(self, keep: list[torch.Tensor]) -> None:
        """Keep, in sharing group `g`, only the tokens at indices `keep[g]` `[B, G, k]` (ascending)."""
        for name, x in self.tensors.items():
            idx = keep[self.group_of_store[name]]
            if idx.shape[1] != x.shape[1]:
                # A store with per-head scalars under a one-head (latent) eviction unit.
                idx = idx.expand(-1, x.shape[1], -1)
            self.tensors[name] = torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))
        self.positions = [torch.gather(p, 2, k) for p, k in zip(self.positions, keep, strict=True)]

    def nbytes(self) -> int:
        """Bytes of every stored tensor (positions, bookkeeping, excluded)."""
        return sum(x.numel() * x.element_size() for x in self.tensors.values())
