"""Retention on the caches of `ArchLM`: per-token eviction of the stored representation.

Shapes: layers `L`, sharing groups `S`, batch `B`, eviction heads `G` (1 on a latent cache), stored
tokens `n`.

A kept set is chosen per sharing group (the layers that read a common store), so a token is kept
or dropped for every layer that reads it; on an MLA latent it is kept or dropped whole (`G = 1`).
In a batch it is chosen per row, on that row's real tokens (padding slots are never candidates).
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
    """Scores and kept sets per sharing group from what the cache observed, for every row of a batch.

    window: h2o's recent part (None: the even split) or snapkv's query window (None: 8);
    kernel: snapkv's pooling width (odd); seed: the random scorer's seed of a one-row scorer (a
    batch's rows keep the generators of the one-row scorers they were stacked or loaded from).

    State per group `g`, row-aligned with the cache's slots: h2o's accumulated mass `[B, G, n]`;
    snapkv's last `w` forwards' probabilities `[B, w, G, n]` (newest last) with `_count` `[B]`
    of them recorded per row. A kept set is chosen per row on its real tokens alone (`keep_row`),
    so it does not depend on the padding or the other rows of the batch.
    """

    name: str
    seed: int = 0
    window: int | None = None
    kernel: int = 7
    _gens: list = field(default_factory=list, init=False, repr=False)  # per row: torch.Generator or None
    _mass: list = field(default_factory=list, init=False, repr=False)  # S x [B, G, n]
    _window: list = field(default_factory=list, init=False, repr=False)  # S x [B, w, G, n]
    _count: torch.Tensor | None = field(default=None, init=False, repr=False)  # [B]

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
        self._gens = [torch.Generator().manual_seed(self.seed) if self.name == "random" else None]

    @property
    def evicts(self) -> bool:
        return self.name != "full"

    @property
    def recent(self) -> int:
        """Newest tokens the cadence protects (the harness scorer's `min_recent`)."""
        return (self.window or 0) if self.name in ("h2o", "snapkv") else 0

    def attach(self, cache: LayoutCache) -> None:
        """Observe `cache`'s attention from now on (h2o, snapkv), starting from empty state."""
        self._mass, self._window, self._count = [None] * len(cache.groups), [None] * len(cache.groups), None
        self.observe(cache)

    def observe(self, cache: LayoutCache) -> None:
        """Route `cache`'s attention probabilities to this scorer, keeping the state it has."""
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
        b, heads, q, n = probs.shape
        if self.name == "h2o":
            acc = self._mass[g]
            acc = probs.new_zeros(b, heads, 0) if acc is None else acc
            self._mass[g] = F.pad(acc, (0, n - acc.shape[-1])) + probs.sum(2)
            return
        w = self.window
        win = self._window[g]
        win = probs.new_zeros(b, w, heads, n) if win is None else F.pad(win, (0, n - win.shape[-1]))
        self._window[g] = torch.cat([win, probs[:, :, -w:].transpose(1, 2)], 1)[:, -w:]
        if g == 0:  # one count per forward, whatever the number of groups
            count = torch.zeros(b, dtype=torch.long) if self._count is None else self._count
            self._count = (count + min(q, w)).clamp(max=w)

    def _window_mean(self, g: int) -> torch.Tensor:
        """`[B, G, n]`: the mean of each row's recorded window probabilities."""
        win, count = self._window[g], self._count.to(self._window[g].device)
        valid = torch.arange(self.window, device=win.device)[None] >= self.window - count[:, None]  # [B, w]
        return (win * valid[:, :, None, None]).sum(1) / count[:, None, None]

    def keep_row(self, g: int, r: int, slots: torch.Tensor, positions: torch.Tensor, protected: torch.Tensor,
                 k: int, next_position: int) -> torch.Tensor:
        """Slots `[G, k]` (ascending) that row `r` keeps in sharing group `g`, chosen among its real
        tokens at `slots` `[G, m]` with their `positions` and `protected` mask `[G, m]`."""
        pos, prot = positions[None], protected[None]  # [1, G, m]: the row alone, as at batch size 1
        if self.name == "random":
            best = topk_keep(torch.rand(pos.shape, generator=self._gens[r]).to(pos.device), prot, k)
        elif self.name == "streaming":
            best = topk_keep(pos.float(), prot, k)
        elif self.name == "h2o":
            mass = self._mass[g][r].gather(-1, slots)[None]
            if self.window is None:
                best = heavy_recent_keep(mass, torch.ones_like(prot), prot, *split_budget(k))
            else:
                best = topk_keep(mass.float(), prot, k)
        else:
            mean = self._window_mean(g)[r].gather(-1, slots)[None]
            candidates = pos < next_position - self.window
            best = topk_keep(pool_candidates(mean, candidates, self.kernel), prot, k)
        return slots.gather(-1, best[0])

    def compacted(self, keep: list[torch.Tensor], pad: list[torch.Tensor]) -> None:
        """Follow a compaction to slots `keep[g]` `[B, G, k]` (padding where `pad[g]`)."""
        for g, (idx, empty) in enumerate(zip(keep, pad, strict=True)):
            if self.name == "h2o":
                self._mass[g] = torch.gather(self._mass[g], 2, idx).masked_fill(empty, 0.0)
            elif self.name == "snapkv":
                w = self.window
                self._window[g] = torch.gather(self._window[g], 3, idx[:, None].expand(-1, w, -1, -1)) \
                    .masked_fill(empty[:, None], 0.0)

    def pad_to(self, n: int) -> None:
        """Zero state for slots up to `n` (the cache was extended)."""
        self._mass = [None if m is None else F.pad(m, (0, n - m.shape[-1])) for m in self._mass]
        self._window = [None if w is None else F.pad(w, (0, n - w.shape[-1])) for w in self._window]

    def load_row(self, r: int, other: GroupScorer, n: int) -> None:
        """Row `r` takes `other`'s one-row state (a sequence prefilled alone), for `n` slots."""
        self.pad_to(n)
        self._gens[r] = other._gens[0]
        for g in range(len(self._mass)):
            if self._mass[g] is not None:
                m = other._mass[g].shape[-1]
                self._mass[g][r] = F.pad(other._mass[g][0], (0, n - m))
            if self._window[g] is not None:
                m = other._window[g].shape[-1]
                self._window[g][r] = F.pad(other._window[g][0], (0, n - m))
        if self._count is not None:
            self._count[r] = other._count[0]

    def select_rows(self, rows: list[int]) -> None:
        """Keep only these rows' state, in this order."""
        idx = torch.tensor(rows)
        self._gens = [self._gens[r] for r in rows]
        self._mass = [None if m is None else m.index_select(0, idx.to(m.device)) for m in self._mass]
        self._window = [None if w is None else w.index_select(0, idx.to(w.device)) for w in self._window]
        if self._count is not None:
            self._count = self._count.index_select(0, idx)

    @staticmethod
    def stack(scorers: list[GroupScorer], n: int) -> GroupScorer:
        """One scorer whose rows are the one-row `scorers`' state, for `n` slots."""
        first = scorers[0]
        out = GroupScorer(first.name, first.seed, first.window, first.kernel)
        out._gens = [s._gens[0] for s in scorers]

        def stacked(states):
            return None if states[0] is None else torch.cat([F.pad(x, (0, n - x.shape[-1])) for x in states])

        out._mass = [stacked([s._mass[g] for s in scorers]) for g in range(len(first._mass))]
        out._window = [stacked([s._window[g] for s in scorers]) for g in range(len(first._window))]
        out._count = None if first._count is None else torch.cat([s._count for s in scorers])
        return out


def compact(cache: LayoutCache, scorer: GroupScorer, cadence: Cadence, rows: list[int],
            next_positions: list[int], prompt_lengths: list[int]) -> None:
    """One compaction of the due `rows` (per row: the absolute position of its next query and its
    prompt length): per sharing group, each keeps `cadence.keep(prompt_length)` tokens (sinks, the
    recent window and, with `protect_prompt`, the prompt protected). Every other row keeps all its
    real tokens: the compaction also drops the padding of the batch."""
    due = set(rows)
    keep, pad = [], []
    for g, positions in enumerate(cache.positions):
        kept = []
        # Row by row (only at a compaction): each due row is scored on its own real tokens, with the
        # shapes it would have alone, which is what makes its kept set independent of the batch.
        for r in range(positions.shape[0]):
            slots = cache.real_slots(g, r)
            if r in due:
                pos = positions[r].gather(-1, slots)
                protected = (pos < cadence.sink) | (pos >= next_positions[r] - cadence.recent)
                if cadence.protect_prompt:
                    protected |= pos < prompt_lengths[r]
                slots = scorer.keep_row(g, r, slots, pos, protected, cadence.keep(prompt_lengths[r]),
                                        next_positions[r])
            kept.append(slots)
        k = max(s.shape[-1] for s in kept)
        keep.append(torch.stack([F.pad(s, (0, k - s.shape[-1])) for s in kept]))
        width = torch.tensor([s.shape[-1] for s in kept], device=positions.device)
        pad.append((torch.arange(k, device=positions.device)[None] >= width[:, None])[:, None].expand_as(keep[-1]))
    cache.compact(keep, pad)
    scorer.compacted(keep, pad)


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
            compact(cache, group_scorer, cadence, [0], [end], [prompt_length])
            compactions += 1
        stored.append(max(cache.stored_lengths()))
        stored_bytes.append(cache.nbytes())
    return LayoutRun(logits, stored, stored_bytes, compactions)
