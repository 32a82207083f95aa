"""The scorer interface (the public one: built-in scorers and plugins implement the same) and the
shared top-k selector. A plugin imports it as `from retention.scorers import CacheView, Scorer`.

Shapes: `L` layers, `B` rows of a view (sequences due for compaction now), `G` KV heads, `n` cached
tokens per row (padded to the longest row of the view), `d` head dimension, `k` tokens to keep.

What a scorer sees at a compaction, `CacheView` (`retention.runtime.cache`); `L` counts eviction groups
(layers on the per-layer K/V layout of a transformers model; the sharing groups of a layout model):
    keys, values   `L` tensors `[B, G, n, d]` (keys after RoPE), in the model's dtype; only on the
                   per-layer K/V layout (empty lists on a layout model: read `stores`)
    stores         per group, store name -> `[B, h, n, d]`; groups: the layers of each group
    positions      `L` tensors `[B, G, n]` int64 absolute positions, -1 on padding
    protected      `L` tensors `[B, G, n]` bool: sinks, the recent window (and the prompt with
                   --protect-prompt); the selector must keep them
    valid          `L` tensors `[B, G, n]` bool, False on padding; padding must never be kept
    next_position  `[B]` int64, each row's next query position
    prompt_length  `[B]` int64;  slots `[B]` int64, the engine slot of each row (per-slot state)
    extra          `L` dicts of per-token buffers a scorer registered with `cache.add_extra`

What a scorer implements (a dataclass; its public fields are its parameters, settable with
`--param NAME.field=value` and in a plan's `scorer_params`, validated against the field types):
    score(view) -> `[B, G, n]` float (one kept set per KV head shared by all layers), or
                   `[L, B, G, n]` with `per_layer = True`. Higher means keep. Padding should score
                   -inf (the default selector masks it anyway).
    select(scores, view, k) -> `[B, G, k]` (or `[L, B, G, k]`) int64 kept indices, distinct, sorted
                   ascending, protected tokens included, padding never. Default: `topk_keep`.
Optional hooks, for scorers that need more than the cache:
    attach(model)   a context manager active for the whole run (record queries, load statistics)
    reset_slot(slot, seed)  engine slot `slot` starts a new sequence: drop that slot's state
    observe(cache, next_position)  after every forward, before any compaction (must not read
                    device values on the host: it runs every token)
    compacted(keep, view)  after every compaction, with the kept indices of the rows of `view`
Class attributes: `reads` (what the scorer reads, alternatives: `retention.policy.registry.READS` names the
kinds; a run refuses a cache layout and model that do not provide one of them, saying what is
missing; `reading()` narrows them when a parameter fixes one), `name` (shown in run ids; `--param NAME.x=...` may use it for a plugin),
`per_layer`, `default_sink` / `default_recent` (protected tokens unless --sink / --recent say),
`default_interval` / `default_prompt` (a preset's interval and prompt rule unless the run's options say),
`evicts` (False: never compacts), and `min_recent()` for a window the cadence must count inside b.

Contract (checked by `retention check-scorer`): exactly k kept per row and head, protected kept,
padding never kept, rows independent of each other (batch invariance: a row's scores may depend
only on that row and its own slot's state), deterministic given the per-sequence seed
(`reset_slot`), and no host reads in `observe`.

Adding a scorer: a built-in is one module in this package whose class sets `name`, listed in
`retention.policy.registry.SCORING` (name -> class); a plugin lives in your own code and is named `package.module:Class`, `path/to/file.py:Class` or by an entry point of group
`retention.scorers` (`retention.plugins`, docs/plugins.md).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.runtime.cache import CacheView
from retention.runtime.capture import capture_queries


def topk_keep(scores: torch.Tensor, protected: torch.Tensor, k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the `k` best tokens per row, protected tokens first, sorted ascending.

    scores: `[..., n]` float; protected: `[..., n]` bool (at most `k` per row); valid: `[..., n]` bool,
    False on padding (scored `-inf`, so never kept while `k` real tokens exist). Returns `[..., k]` int64.
    Ties go to the lower index (stable sort), the same rule as a greedy `argmax` pick, which is what
    makes `alpha` at lambda = 0 reproduce this selection bit for bit.
    """
    return torch.sort(keep_order(scores, protected, valid)[..., :k], dim=-1).values


def keep_order(scores: torch.Tensor, protected: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """`[..., n]` int64: every token index of each row in the order `topk_keep` keeps them
    (protected first, then by score in float32, ties to the lower index, padding last); the first
    `k` entries are `topk_keep`'s kept set for any `k` (the allocating routings take a different
    number per head from this one order)."""
    s = scores.float()
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    s = s.masked_fill(protected, float("inf"))
    return torch.sort(s, dim=-1, descending=True, stable=True).indices


@dataclass
class Scorer:
    """Base class: subclasses implement `score` (and optionally `select`, `attach`, `observe`)."""

    name: ClassVar[str] = "base"
    # What the scorer reads: alternatives, each a set of `READS` kinds (any one satisfied suffices).
    reads: ClassVar[tuple[frozenset[str], ...]] = (frozenset({"positions"}),)
    per_layer: ClassVar[bool] = False
    # The kept-set structures this scorer can score in, its default first: `shared` (scores `[B, G,
    # n]`, one kept set per KV head for all layers) and `per-layer` (`[L, B, G, n]`). The routing
    # family chooses (`Routing.chooses`, then `structured`); empty: one structure of its own,
    # which `per_layer` says.
    structures: ClassVar[tuple[str, ...]] = ()
    # Protected tokens a scorer wants by default (the CLI's --sink / --recent override them).
    default_sink: ClassVar[int] = 0
    default_recent: ClassVar[int] = 0
    # A preset's cadence interval (None: the default `min(128, B)`) and prompt rule (PROMPT_RULES:
    # "evict" leaves the prompt an ordinary candidate) unless the run's options say otherwise.
    default_interval: ClassVar[int | None] = None
    default_prompt: ClassVar[str] = "evict"
    # False for `full`: the policy never compacts.
    evicts: ClassVar[bool] = True
    # True: what the scorer learns from a forward it reads from the cache's stored tokens (its `observe`
    # on a row's own cache), never from the forward itself (recorded queries, attention), so the engine
    # may prefill prompts that start together in one right-padded forward (`retention.runtime.prefill`)
    # whose padding such a scorer never sees. False (the safe default): each prompt is prefilled alone.
    batch_prefill: ClassVar[bool] = False

    def structured(self, structure: str) -> Scorer:
        """This scorer, set to score in kept-set `structure` (one of `structures`), as the routing
        family chose when the policy was built (a fresh scorer per run: it is set in place)."""
        if structure not in self.structures:
            offered = ", ".join(self.structures) or "one structure of its own"
            raise RetentionError(f"scorer {self.name!r} scores in {offered}, not {structure!r}")
        self._structure = structure
        return self

    def reading(self) -> tuple[frozenset[str], ...]:
        """What this instance reads (`reads`, or fewer alternatives when a parameter fixes one)."""
        return self.reads

    def attach(self, model) -> contextlib.AbstractContextManager:
        """Set-up for one run on `model` (load statistics, start recording queries)."""
        return contextlib.nullcontext()

    def reset(self) -> None:
        """A run starts: clear state from a previous run."""

    def min_recent(self) -> int:
        """Newest tokens this scorer always keeps (counted inside `b` by the cadence)."""
        return 0

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
    """A scorer that reads the queries the model computes (`retention.runtime.capture`) and protects its
    `window` newest tokens (counted inside `b` by the cadence through `min_recent`).

    While attached, `self._recorder` holds the query recorder; `reset()` (called by the engine when a run
    starts) clears per-run state; `reset_slot` that of one slot.
    """

    per_layer: ClassVar[bool] = True
    window: int = 8
    _recorder: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.window <= 0:
            raise RetentionError(f"--window must be a positive number of tokens, got {self.window}")

    def min_recent(self) -> int:
        """The window tokens are kept at every compaction; the cadence counts them inside `b`."""
        return self.window

    def reset(self) -> None:
        """Clear state from a previous generation."""

    @contextlib.contextmanager
    def _attached(self, model):
        with capture_queries(model) as rec:
            self._recorder = rec
            try:
                yield self
            finally:
                self._recorder = None

    def attach(self, model):
        """Record the model's queries; a layout model reports attention through its cache instead."""
        if getattr(model, "reports_attention", False):
            return contextlib.nullcontext(self)
        return self._attached(model)
