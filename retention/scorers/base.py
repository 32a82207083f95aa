"""The scorer interface and the shared top-k selector.

A scorer maps the cache at a compaction (`CacheView`) to a score per candidate token: `[B, G, n]`
when one kept set per KV head is shared by all layers, or `[L, B, G, n]` when it selects per layer
(`per_layer = True`). Higher means keep. A selector turns scores into kept indices; the default
is top-k per row with protected tokens forced in. Scorers that need more than the cache (recorded
queries, accumulated attention) get it through `attach` (a context manager active for the whole
run), `observe` (called after every forward), `compacted` (called with the kept indices so state can
follow the eviction) and `reset_slot` (called when an engine slot starts a new sequence).

Batched views (`retention.cache.CacheView`): rows are the slots due now, padded to the longest; a
scorer scores padding `-inf` (the shared selector masks it too), so padding is never kept and never
outranks a real token. Per-slot state is indexed by `view.slots` / `cache.slots`.

Adding a scorer: one module in this package with a class decorated by `@register("name")`, listed in
`retention.scorers._MODULES`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.cache import CacheView


def topk_keep(scores: torch.Tensor, protected: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the `k` best tokens per row, protected tokens first, sorted ascending.

    scores: `[..., n]` float; protected: `[..., n]` bool (at most `k` per row); valid: `[..., n]` bool,
    False on padding (scored `-inf`, so never kept while `k` real tokens exist). Returns `[..., k]` int64.
    Ties go to the lower index (stable sort), the same rule as a greedy `argmax` pick, which is what
    makes `alpha` at lambda = 0 reproduce this selection bit for bit.
    """
    s = scores.float()
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    s = s.masked_fill(protected, float("inf"))
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


@dataclass
class Scorer:
    """Base class: subclasses implement `score` (and optionally `select`, `attach`, `observe`)."""

    name: ClassVar[str] = "base"
    per_layer: ClassVar[bool] = False
    # Protected tokens a scorer wants by default (the CLI's --sink / --recent override them).
    default_sink: ClassVar[int] = 0
    default_recent: ClassVar[int] = 0
    # False for `full`: the policy never compacts.
    evicts: ClassVar[bool] = True

    def attach(self, model) -> contextlib.AbstractContextManager:
        """Set-up for one run on `model` (load statistics, start recording queries)."""
        return contextlib.nullcontext()

    def reset_slot(self, slot: int, seed: int) -> None:
        """Engine slot `slot` starts a new sequence whose seed is `seed`: drop that slot's state."""

    def observe(self, cache, next_position: list[int]) -> None:
        """Called after every forward (prefill included), before any compaction; `next_position`
        holds each cache row's next query position (`cache.slots[r]` is row `r`'s slot)."""

    def score(self, view: CacheView) -> torch.Tensor:
        raise NotImplementedError

    def masks(self, view: CacheView) -> tuple[torch.Tensor, torch.Tensor]:
        """(protected, valid) shaped like the scores: `[B, G, n]` or `[L, B, G, n]` per layer."""
        if self.per_layer:
            return torch.stack(view.protected), torch.stack(view.valid)
        return view.protected[0], view.valid[0]

    def select(self, scores: torch.Tensor, view: CacheView, k: int) -> torch.Tensor:
        """Kept indices `[B, G, k]` (or `[L, B, G, k]` per layer), sorted ascending; padding never kept."""
        protected, valid = self.masks(view)
        return topk_keep(scores, protected, k, valid)

    def compacted(self, keep: torch.Tensor, view: CacheView) -> None:
        """Called with the kept indices (of the rows of `view`) after every compaction."""


@dataclass
class WindowScorer(Scorer):
    """A scorer that reads the queries the model computes (`retention.capture`) and protects its
    `window` newest tokens (counted inside `b` by the cadence through `min_recent`).

    While attached, `self._recorder` holds the query recorder; `reset()` (called by the engine when a run
    starts) clears per-run state; `reset_slot` that of one slot.
    """

    per_layer: ClassVar[bool] = True
    window: int = 8
    _recorder: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        from retention.errors import RetentionError

        if self.window <= 0:
            raise RetentionError(f"--window must be a positive number of tokens, got {self.window}")

    def min_recent(self) -> int:
        """The window tokens are kept at every compaction; the cadence counts them inside `b`."""
        return self.window

    def reset(self) -> None:
        """Clear state from a previous generation."""

    @contextlib.contextmanager
    def _attached(self, model):
        from retention.capture import capture_queries

        with capture_queries(model) as rec:
            self._recorder = rec
            try:
                yield self
            finally:
                self._recorder = None

    def attach(self, model):
        return self._attached(model)
