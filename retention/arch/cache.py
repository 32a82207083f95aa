"""A cache that stores exactly the `Store`s of a `CacheLayout` and evicts per sharing group.

Shapes: batch `B`, a store's heads `h`, stored tokens `n`, its per-head width `d`; `G` is the
layout's eviction heads (`kv_heads`: 1 for an MLA latent, so a token is kept or dropped whole).

Every store of a sharing group holds the same tokens in the same order, with one position tensor
`[B, G, n]` per group: a compaction gathers all of the group's stores with the group's kept
indices, so a token a sharing layer evicted is gone for every layer that reads it.

Rows (sequences of a batch) hold different numbers of tokens: a row's unused slots are padding, at
position `PAD`, later than every query, so the causal mask hides them (their values are finite
zeros or stale copies). `row_lengths` counts each row's real tokens, `real_slots` finds them.

Memory: each store is a preallocated buffer `[B, h, capacity, d]` written in place (a decode step
copies only its new token, not the whole cache), grown by doubling when full. A compaction gathers
the kept tokens into a new buffer of `max(capacity, kept)` tokens, so the memory of evicted tokens
is released, as in `retention.cache.RetentionLayer.compact`. `tensors[name]` is the view of the
stored tokens `[B, h, n, d]`; `nbytes` counts them, `allocated_bytes` the buffers.
"""

from __future__ import annotations

import torch

from retention.layouts import CacheLayout

PAD = 2**62  # the position of a padding slot: after every query, so never attended to


class LayoutCache:
    """Stored tensors `[B, h, n, d]` by store name, positions `[B, G, n]` by sharing group.

    capacity: tokens each store's buffer holds before it grows (e.g. `b + N` under a budget, prompt +
    new tokens for the full cache); 0 sizes buffers from the first write.
    """

    def __init__(self, layout: CacheLayout, capacity: int = 0):
        self.layout = layout
        self.capacity = capacity
        self.groups = layout.groups()
        self.group_of_layer = {layer: g for g, members in enumerate(self.groups) for layer in members}
        self.group_of_store = {s.name: self.group_of_layer[s.writer] for s in layout.stores}
        self.tensors: dict[str, torch.Tensor] = {}
        self._buffers: dict[str, torch.Tensor] = {}
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
        self.positions = [new.clone() if p is None else torch.cat([p, new], -1) for p in self.positions]

    def _buffer(self, name: str, like: torch.Tensor, tokens: int) -> torch.Tensor:
        """A new buffer for `tokens` tokens of store `name` (at least `capacity`), shaped like `like`."""
        b, h, _, d = like.shape
        buf = like.new_empty(b, h, max(self.capacity, tokens), d)
        self._buffers[name] = buf
        return buf

    def append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Write `x` `[B, h, q, d]` after store `name`'s tokens; return everything it holds `[B, h, n, d]`."""
        old = self.tensors.get(name)
        n, q = (0 if old is None else old.shape[2]), x.shape[2]
        buf = self._buffers.get(name)
        in_place = buf is not None and old is not None and old.data_ptr() == buf.data_ptr()
        if not in_place or n + q > buf.shape[2]:
            grown = self._buffer(name, x, 2 * (n + q) if old is not None else n + q)
            if n:
                grown[:, :, :n] = old
            buf = grown
        buf[:, :, n:n + q] = x
        self.tensors[name] = buf[:, :, :n + q]
        return self.tensors[name]

    def truncate(self, n: int) -> None:
        """Forget every token after the first `n` of each store and group (benchmarks rewind a step)."""
        self.tensors = {k: v[:, :, :n] for k, v in self.tensors.items()}
        self.positions = [None if p is None else p[..., :n] for p in self.positions]

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
        """Stored slots per layer (its sharing group's; padding included when rows differ)."""
        return [int(self.layer_positions(i).shape[-1]) if self.positions[0] is not None else 0
                for i in range(self.layout.layers)]

    def row_lengths(self) -> list[int]:
        """Real (not padding) tokens per row: the same in every sharing group and eviction head."""
        return [] if self.positions[0] is None else (self.positions[0][:, 0] != PAD).sum(-1).tolist()

    def real_slots(self, g: int, r: int) -> torch.Tensor:
        """Slots `[G, m]` (ascending) of row `r`'s real tokens in sharing group `g`."""
        real = self.positions[g][r] != PAD  # [G, n]
        return real.nonzero()[:, 1].view(real.shape[0], -1)

    def extend(self, n: int) -> None:
        """Pad every store and group to at least `n` slots."""
        short = n - self.positions[0].shape[-1]
        if short <= 0:
            return
        for name, x in list(self.tensors.items()):
            self.append(name, x.new_zeros(x.shape[0], x.shape[1], short, x.shape[3]))
        self.positions = [torch.cat([p, p.new_full((*p.shape[:2], short), PAD)], -1) for p in self.positions]

    def load_row(self, r: int, other: LayoutCache) -> None:
        """Put `other`'s one row (a sequence prefilled alone) in row `r`, padded to this cache's slots."""
        m = other.positions[0].shape[-1]
        self.extend(m)
        for name, x in self.tensors.items():
            x[r, :, :m] = other.tensors[name][0]
            x[r, :, m:] = 0
        for p, q in zip(self.positions, other.positions, strict=True):
            p[r, :, :m] = q[0]
            p[r, :, m:] = PAD

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (finished sequences leave the batch)."""
        idx = torch.tensor(rows, device=self.positions[0].device)
        self.tensors = {k: v.index_select(0, idx) for k, v in self.tensors.items()}
        self._buffers = {}  # the next append reallocates
        self.positions = [p.index_select(0, idx) for p in self.positions]

    @staticmethod
    def stack(caches: list[LayoutCache], capacity: int = 0) -> LayoutCache:
        """One cache whose rows are the one-row `caches`, each padded to the longest."""
        first = caches[0]
        out = LayoutCache(first.layout, capacity)
        n = max(c.positions[0].shape[-1] for c in caches)
        for name, x in first.tensors.items():
            out.append(name, x.new_zeros(len(caches), x.shape[1], n, x.shape[3]))
        out.positions = [p.new_full((len(caches), p.shape[1], n), PAD) for p in first.positions]
        for r, c in enumerate(caches):
            out.load_row(r, c)
        return out

    def compact(self, keep: list[torch.Tensor], pad: list[torch.Tensor] | None = None) -> None:
        """Keep, in sharing group `g`, only the tokens at indices `keep[g]` `[B, G, k]` (ascending);
        where `pad[g]` `[B, G, k]` is True the kept slot becomes padding (a row keeping fewer than k)."""
        for name, x in self.tensors.items():
            idx = keep[self.group_of_store[name]]
            if idx.shape[1] != x.shape[1]:
                # A store with per-head scalars under a one-head (latent) eviction unit.
                idx = idx.expand(-1, x.shape[1], -1)
            kept = torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))
            buf = self._buffer(name, kept, kept.shape[2])
            buf[:, :, :kept.shape[2]] = kept
            self.tensors[name] = buf[:, :, :kept.shape[2]]
        self.positions = [torch.gather(p, 2, k) for p, k in zip(self.positions, keep, strict=True)]
        if pad is not None:
            self.positions = [p.masked_fill(m, PAD) for p, m in zip(self.positions, pad, strict=True)]

    def nbytes(self) -> int:
        """Bytes of every stored token's tensors (positions, bookkeeping and free buffer space excluded)."""
        return sum(x.numel() * x.element_size() for x in self.tensors.values())

    def allocated_bytes(self) -> int:
        """Bytes of the buffers (stored tokens plus the room preallocated for the coming ones)."""
        return sum(x.numel() * x.element_size() for x in self._buffers.values())
