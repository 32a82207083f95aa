"""The retention cache: a transformers `Cache` whose layers physically shrink at a compaction.

Shapes: batch `B`, KV heads `G`, stored tokens `n`, head dim `d`, layers `L`.

Each layer stores exactly what the model wrote (post-RoPE keys, values: `[B, G, n, d]`) and, per KV
head, the original absolute position of every stored token (`[B, G, n]`, int64). The model's own
attention code runs unchanged: it calls `update`, receives the stored keys/values and attends to all
of them. Eviction is a gather into new, smaller tensors (`compact`), so memory really shrinks; every
KV head of a layer keeps the same number of tokens so tensors stay rectangular, while different heads
may keep different tokens.

Positions are never compacted and stored keys are never re-rotated: the caller passes explicit
absolute `position_ids` for every forward (see `set_step_positions`), because after a compaction the
model would otherwise infer positions from the (shorter) cache length and silently decode garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RetentionLayer(DynamicLayer):
    """One layer of the retention cache: `keys`/`values` `[B, G, n, d]`, `positions` `[B, G, n]`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, g = key_states.shape[:2]
        self.positions = torch.empty(b, g, 0, dtype=torch.long, device=key_states.device)

    def append_positions(self, step_positions: torch.Tensor) -> None:
        """Record the absolute positions `[B, q]` of the tokens just appended, for every KV head."""
        b, g = self.keys.shape[:2]
        new = step_positions.to(self.positions.device)[:, None, :].expand(b, g, -1)
        self.positions = torch.cat([self.positions, new], dim=-1)

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the stored tokens at indices `keep` `[B, G, k]` (int64, any order).

        The result is stored in the order of `keep`; callers pass indices sorted ascending so that
        tokens stay in position order. New tensors are allocated: the old ones are freed.
        """
        d = self.keys.shape[-1]
        idx = keep[..., None].expand(-1, -1, -1, d)
        self.keys = torch.gather(self.keys, 2, idx)
        self.values = torch.gather(self.values, 2, keep[..., None].expand(-1, -1, -1, self.values.shape[-1]))
        self.positions = torch.gather(self.positions, 2, keep)

    def reset(self) -> None:
        super().reset()
        self.positions = None


@dataclass
class CacheView:
    """What a scorer sees at a compaction (read-only by convention).

    keys, values: `L` tensors `[B, G, n, d]` (post-RoPE keys exactly as the model stored them).
    positions: `L` tensors `[B, G, n]` int64, original absolute positions.
    protected: `L` tensors `[B, G, n]` bool, tokens that must be kept (sinks, recent window).
    next_position: absolute position `t` of the next query.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    protected: list[torch.Tensor]
    next_position: int

    @property
    def num_layers(self) -> int:
        return len(self.keys)


class RetentionCache(Cache):
    """A transformers `Cache` of `RetentionLayer`s that a retention policy compacts between steps.

    Use: before every forward, `set_step_positions(position_ids)`; after the forward, the policy may
    call `view(...)` and `compact(...)`. With no compaction this cache behaves exactly like
    `DynamicCache` (same concatenation, same tensors), which the exactness tests hold.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[RetentionLayer() for _ in range(num_layers)])
        self._step_positions: torch.Tensor | None = None

    def set_step_positions(self, position_ids: torch.Tensor) -> None:
        """Absolute positions `[B, q]` of the tokens the next forward appends."""
        self._step_positions = position_ids

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self._step_positions is None:
            raise RuntimeError("RetentionCache.update called without set_step_positions()")
        keys, values = self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        self.layers[layer_idx].append_positions(self._step_positions)
        return keys, values

    def stored_lengths(self) -> list[int]:
        """Stored tokens per layer (every KV head of a layer holds the same number)."""
        return [layer.get_seq_length() for layer in self.layers]

    def view(self, next_position: int, sink: int = 0, recent: int = 0) -> CacheView:
        """A `CacheView` with sinks (`position < sink`) and the `recent` newest positions protected."""
        positions = [layer.positions for layer in self.layers]
        protected = [(p < sink) | (p >= next_position - recent) for p in positions]
        return CacheView(
            keys=[layer.keys for layer in self.layers],
            values=[layer.values for layer in self.layers],
            positions=positions,
            protected=protected,
            next_position=next_position,
        )

    def compact(self, keep: torch.Tensor) -> None:
        """Evict everything but `keep`: `[B, G, k]` shared by all layers, or `[L, B, G, k]` per layer."""
        for i, layer in enumerate(self.layers):
            layer.compact(keep if keep.dim() == 3 else keep[i])
