"""Decoding an `ArchLM` under retention: per-token eviction of the stored representation.

Shapes: layers `L`, sharing groups `S`, batch `B`, eviction heads `G` (1 on a latent cache), stored
tokens `n`.

A kept set is chosen per sharing group (the layers that read a common store), so a token is kept
or dropped for every layer that reads it; on an MLA latent it is kept or dropped whole (`G = 1`).
Scores per group `[B, G, n]`:

* `full`: never evicts. `random`: seeded uniform. `streaming`: position (sinks protected).
* `h2o`: attention probability each stored token received, accumulated over every forward, summed
  over the group's layers and query heads (on a latent cache: the absorbed queries' probabilities
  against the latent, which equal the materialised ones). Follows every compaction.
* `snapkv`: the probabilities of the last `window` queries, averaged, summed over the group's
  layers, max-pooled (kernel 7), with the `window` newest tokens protected.
* `triattention` and `alpha` are refused on these caches: both score a key from calibrated per-head
  statistics of post-RoPE queries against per-head post-RoPE keys; a latent cache stores no
  per-head key (its position lives only in the shared RoPE key) and a shared store has no single
  layer's statistics, so neither is defined here without a new derivation.

The cadence (`retention.cadence.Cadence`) is the harness's: nominal `b` kept per group after a
compaction, compaction when `b + interval` are stored. `budget_bytes` converts to tokens with the
layout's bytes per token, so layouts compare at matched memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from retention.arch.cache import LayoutCache
from retention.arch.model import ArchLM
from retention.cadence import Cadence, default_interval
from retention.errors import RetentionError
from retention.layouts import tokens_for_bytes
from retention.scorers.base import topk_keep

SCORERS = ("full", "random", "streaming", "h2o", "snapkv")
REFUSED = ("triattention", "alpha")


# What the harness's own cache (`retention run` on a transformers DeepSeek-V2/V3 checkpoint, which
# caches the latent and the RoPE key) supports on a latent layout: the scorers that read no queries.
LATENT_RUN_SCORERS = ("full", "random", "streaming")


def check_run_scorers(layout, names: list[str]) -> None:
    """Refuse, in one line, `retention run` scorers that read queries against per-head keys on a
    latent cache (their captured queries do not match a latent; `retention.arch` scores those)."""
    if not layout.is_latent:
        return
    bad = [n for n in names if n not in LATENT_RUN_SCORERS]
    if bad:
        raise RetentionError(
            f"{', '.join(bad)} cannot score a latent (MLA) cache in `retention run`: the stored keys are the latent "
            f"and RoPE key, not per-head keys; use {', '.join(LATENT_RUN_SCORERS)}"
        )


@dataclass
class GroupScorer:
    """Scores `[B, G, n]` per sharing group from what the cache observed."""

    name: str
    seed: int = 0
    window: int = 8
    kernel: int = 7
    _gen: torch.Generator | None = field(default=None, init=False, repr=False)
    _mass: list = field(default_factory=list, init=False, repr=False)  # S x [B, G, n]
    _recent: list = field(default_factory=list, init=False, repr=False)  # S x list of [B, G, n]

    def __post_init__(self):
        if self.name in REFUSED:
            raise RetentionError(
                f"{self.name} is not defined on latent or shared-storage caches: it scores per-head post-RoPE keys "
                "from calibrated per-head query statistics, which such a cache does not store; use one of "
                + ", ".join(SCORERS)
            )
        if self.name not in SCORERS:
            raise RetentionError(f"unknown scorer {self.name!r} on a layout cache: use one of {', '.join(SCORERS)}")

    @property
    def evicts(self) -> bool:
        return self.name != "full"

    @property
    def recent(self) -> int:
        return self.window if self.name in ("h2o", "snapkv") else 0

    def attach(self, cache: LayoutCache) -> None:
        """Start observing the cache's attention (h2o, snapkv)."""
        self._mass = [None] * len(cache.groups)
        self._recent = [[] for _ in cache.groups]
        if self.name not in ("h2o", "snapkv"):
            return
        pending: dict[int, torch.Tensor] = {}

        def observer(layer: int, probs: torch.Tensor) -> None:
            # probs [B, G, q, n]: per group, summed over its layers.
            g = cache.group_of_layer[layer]
            pending[g] = probs if g not in pending else pending[g] + probs
            if layer == cache.groups[g][-1]:
                self._take(g, pending.pop(g))

        cache.observer = observer

    def _take(self, g: int, probs: torch.Tensor) -> None:
        n = probs.shape[-1]
        if self.name == "h2o":
            acc = self._mass[g]
            acc = probs.new_zeros(probs.shape[:2] + (0,)) if acc is None else acc
            self._mass[g] = F.pad(acc, (0, n - acc.shape[-1])) + probs.sum(2)
        else:
            rows = [F.pad(r, (0, n - r.shape[-1])) for r in self._recent[g]] + list(probs.unbind(2))
            self._recent[g] = rows[-self.window :]

    def score(self, g: int, positions: torch.Tensor) -> torch.Tensor:
        """Scores `[B, G, n]` of sharing group `g` whose stored positions are `positions`."""
        if self.name == "random":
            if self._gen is None:
                self._gen = torch.Generator().manual_seed(self.seed)
            return torch.rand(positions.shape, generator=self._gen).to(positions.device)
        if self.name == "streaming":
            return positions.float()
        if self.name == "h2o":
            return self._mass[g].float()
        n = positions.shape[-1]
        mean = torch.stack([F.pad(r, (0, n - r.shape[-1])) for r in self._recent[g]]).mean(0)
        b, h, _ = mean.shape
        return F.max_pool1d(mean.reshape(b * h, 1, n).float(), self.kernel, 1, self.kernel // 2).reshape(b, h, n)

    def compacted(self, g: int, keep: torch.Tensor, n: int) -> None:
        """Follow group `g`'s compaction from `n` stored tokens to the indices `keep` `[B, G, k]`."""
        if self.name == "h2o":
            self._mass[g] = torch.gather(self._mass[g], 2, keep)
        elif self.name == "snapkv":
            self._recent[g] = [torch.gather(F.pad(r, (0, n - r.shape[-1])), 2, keep) for r in self._recent[g]]


def compact(cache: LayoutCache, scorer: GroupScorer, cadence: Cadence, next_position: int) -> None:
    """One compaction: per sharing group, keep the nominal `b` best (sinks and recent protected)."""
    keep, lengths = [], [p.shape[-1] for p in cache.positions]
    for g, positions in enumerate(cache.positions):
        protected = (positions < cadence.sink) | (positions >= next_position - cadence.recent)
        keep.append(topk_keep(scorer.score(g, positions), protected, cadence.nominal))
    cache.compact(keep)
    for g, k in enumerate(keep):
        scorer.compacted(g, k, lengths[g])


@dataclass
class LayoutRun:
    logits: list[torch.Tensor]  # per decoded position: next-token logits [V]
    stored: list[int]  # stored tokens (max over layers) after each forward
    stored_bytes: list[int]  # bytes of stored tensors after each forward
    compactions: int


@torch.no_grad()
def decode(model: ArchLM, token_ids: list[int], prompt_length: int, scorer: str = "full", *,
           budget: int | None = None, budget_bytes: int | None = None, interval: int | None = None,
           sink: int = 4, seed: int = 0) -> LayoutRun:
    """Teacher-forced decode of `token_ids` (the first `prompt_length` as one prefill, then one token
    per step) under retention; the logits after each forward, and what the cache held."""
    cache = model.new_cache()
    group_scorer = GroupScorer(scorer, seed=seed)
    if budget_bytes is not None:
        budget = tokens_for_bytes(cache.layout, budget_bytes)
    budget = budget if group_scorer.evicts else None
    cadence = Cadence(budget=budget, interval=interval or (default_interval(budget) if budget else 1),
                      sink=sink, recent=group_scorer.recent)
    group_scorer.attach(cache)
    ids = torch.tensor([token_ids])
    logits, stored, stored_bytes, compactions = [], [], [], 0
    steps = [(0, prompt_length)] + [(i, i + 1) for i in range(prompt_length, len(token_ids))]
    for start, end in steps:
        pos = torch.arange(start, end)[None]
        logits.append(model(ids[:, start:end], pos, cache, logits_to_keep=1).logits[0, -1])
        if cadence.evicts and cadence.due(max(cache.stored_lengths()), prefill=start == 0):
            compact(cache, group_scorer, cadence, end)
            compactions += 1
        stored.append(max(cache.stored_lengths()))
        stored_bytes.append(cache.nbytes())
    return LayoutRun(logits, stored, stored_bytes, compactions)
