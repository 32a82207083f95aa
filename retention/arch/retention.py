"""Retention on the caches of `ArchLM`: per-token eviction of the stored representation.

Shapes: layers `L`, sharing groups `S`, batch `B`, eviction heads `G` (1 on a latent cache), stored
tokens `n`.

A kept set is chosen per sharing group (the layers that read a common store), so a token is kept
or dropped for every layer that reads it; on an MLA latent it is kept or dropped whole (`G = 1`).
Scores per group `[B, G, n]`, with the harness's parameters and selection rules:

* `full`: never evicts. `random`: uniform, seeded by the sequence's seed. `streaming`: position.
* `h2o`: the attention probability each stored token received, accumulated over every forward,
  summed over the group's layers and query heads (on a latent cache: the absorbed queries'
  probabilities against the latent, which equal the materialised ones). It follows every
  compaction. Selection as `retention.scorers.h2o`: with `window=None` the reference's even split
  (the `k - k // 2` newest plus the `k // 2` heaviest of the rest), else `window` newest protected.
* `snapkv`: the probabilities of the last `window` queries (default 8), averaged, summed over the
  group's layers and query heads, max-pooled over the stored order (kernel 7) among the candidates
  (every token but the window's own), with the `window` newest protected. Unlike the per-head
  `retention.scorers.snapkv` it pools probabilities normalised over every stored token (a group
  sums several layers' softmaxes), not logits maxed over the query heads.
* `triattention` and `alpha` are refused: both score a key from calibrated per-head statistics of
  post-RoPE queries against per-head post-RoPE keys; a latent cache stores no per-head key (its
  position lives only in the shared RoPE key) and a shared store has no single layer's statistics,
  so neither is defined here without a new derivation. `rkv` (redundancy between per-head keys)
  is refused for the same reason.

The cadence is the harness's (`retention.cadence.Cadence`): nominal `b` kept per group after a
compaction, compaction when `b + interval` are stored, sinks and the recent window protected, the
prompt too with `protect_prompt`. `budget_bytes` converts to tokens with the layout's bytes per
token, so layouts compare at matched memory. `retention.arch.generate` decodes through these
functions for `retention run`; `decode` below is the teacher-forced form used by tests.
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
from retention.scorers.h2o import heavy_recent_keep, split_budget
from retention.scorers.snapkv import pool_candidates

SCORERS = ("full", "random", "streaming", "h2o", "snapkv")
REFUSED = ("triattention", "alpha", "rkv")
SNAPKV_WINDOW = 8


# What the harness's own cache (`retention run` on a transformers DeepSeek-V2/V3 checkpoint, which
# caches the latent and the RoPE key) supports on a latent layout: the scorers that read no queries.
LATENT_RUN_SCORERS = ("full", "random", "streaming")


def check_run_scorers(model_kind: str, layout, names: list[str]) -> None:
    """Refuse, in one line, scorers `retention run` cannot apply to this model's cache: on a
    reference layout model (`model_kind == "arch"`) those outside `SCORERS`; on a transformers
    latent (MLA) checkpoint those that read queries against per-head keys."""
    if model_kind == "arch":
        bad = [n for n in names if n not in SCORERS]
        if bad:
            raise RetentionError(f"{', '.join(bad)} cannot score the {layout.name} cache: it scores per-head "
                                 f"post-RoPE keys, which a latent or shared-storage cache does not store; use "
                                 f"{', '.join(SCORERS)}")
        return
    if not layout.is_latent:
        return
    bad = [n for n in names if n not in LATENT_RUN_SCORERS]
    if bad:
        raise RetentionError(
            f"{', '.join(bad)} cannot score a latent (MLA) cache in `retention run`: the stored keys are the latent "
            f"and RoPE key, not per-head keys; use {', '.join(LATENT_RUN_SCORERS)}, or --engine reference (the "
            "reference MLA modules) for h2o and snapkv"
        )


@dataclass
class GroupScorer:
    """Scores and kept sets per sharing group from what the cache observed (one sequence's state).

    window: h2o's recent part (None: the even split) or snapkv's query window (None: 8);
    kernel: snapkv's pooling width (odd).
    """

    name: str
    seed: int = 0
    window: int | None = None
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
        if self.name == "snapkv" and self.window is None:
            self.window = SNAPKV_WINDOW
        if self.window is not None and self.window <= 0:
            raise RetentionError(f"--window must be a positive number of tokens, got {self.window}")
        if self.kernel <= 0 or self.kernel % 2 == 0:
            raise RetentionError(f"the pooling kernel must be a positive odd number, got {self.kernel}")

    @property
    def evicts(self) -> bool:
        return self.name != "full"

    @property
    def recent(self) -> int:
        """Newest tokens the cadence protects (the harness scorer's `min_recent`)."""
        return (self.window or 0) if self.name in ("h2o", "snapkv") else 0

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

    def keep(self, g: int, positions: torch.Tensor, protected: torch.Tensor, k: int,
             next_position: int) -> torch.Tensor:
        """Indices `[B, G, k]` (ascending) that sharing group `g` keeps of its stored `positions`
        `[B, G, n]`; `protected` `[B, G, n]` bool is always kept."""
        if self.name == "random":
            if self._gen is None:
                self._gen = torch.Generator().manual_seed(self.seed)
            return topk_keep(torch.rand(positions.shape, generator=self._gen).to(positions.device), protected, k)
        if self.name == "streaming":
            return topk_keep(positions.float(), protected, k)
        if self.name == "h2o":
            if self.window is None:
                valid = torch.ones_like(protected)
                return heavy_recent_keep(self._mass[g], valid, protected, *split_budget(k))
            return topk_keep(self._mass[g].float(), protected, k)
        n = positions.shape[-1]
        mean = torch.stack([F.pad(r, (0, n - r.shape[-1])) for r in self._recent[g]]).mean(0)
        candidates = positions < next_position - self.window
        return topk_keep(pool_candidates(mean, candidates, self.kernel), protected, k)

    def compacted(self, g: int, keep: torch.Tensor, n: int) -> None:
        """Follow group `g`'s compaction from `n` stored tokens to the indices `keep` `[B, G, k]`."""
        if self.name == "h2o":
            self._mass[g] = torch.gather(self._mass[g], 2, keep)
        elif self.name == "snapkv":
            self._recent[g] = [torch.gather(F.pad(r, (0, n - r.shape[-1])), 2, keep) for r in self._recent[g]]


def compact(cache: LayoutCache, scorer: GroupScorer, cadence: Cadence, next_position: int,
            prompt_length: int = 0) -> None:
    """One compaction: per sharing group, keep `cadence.keep(prompt_length)` tokens (sinks, the
    recent window and, with `protect_prompt`, the prompt protected)."""
    keep, lengths = [], [p.shape[-1] for p in cache.positions]
    k = cadence.keep(prompt_length)
    for g, positions in enumerate(cache.positions):
        protected = (positions < cadence.sink) | (positions >= next_position - cadence.recent)
        if cadence.protect_prompt:
            protected |= positions < prompt_length
        keep.append(scorer.keep(g, positions, protected, k, next_position))
    cache.compact(keep)
    for g, idx in enumerate(keep):
        scorer.compacted(g, idx, lengths[g])


@dataclass
class LayoutRun:
    logits: list[torch.Tensor]  # per decoded position: next-token logits [V]
    stored: list[int]  # stored tokens (max over layers) after each forward
    stored_bytes: list[int]  # bytes of stored tensors after each forward
    compactions: int


@torch.no_grad()
def decode(model: ArchLM, token_ids: list[int], prompt_length: int, scorer: str = "full", *,
           budget: int | None = None, budget_bytes: int | None = None, interval: int | None = None,
           sink: int = 4, seed: int = 0, window: int | None = None) -> LayoutRun:
    """Teacher-forced decode of `token_ids` (the first `prompt_length` as one prefill, then one token
    per step) under retention; the logits after each forward, and what the cache held."""
    cache = model.new_cache()
    group_scorer = GroupScorer(scorer, seed=seed, window=window)
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
            compact(cache, group_scorer, cadence, end, prompt_length)
            compactions += 1
        stored.append(max(cache.stored_lengths()))
        stored_bytes.append(cache.nbytes())
    return LayoutRun(logits, stored, stored_bytes, compactions)
