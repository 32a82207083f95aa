"""The routing family: which kept set each layer follows, and how the budget is split over layers and
KV heads.

A routing sees the scorer before the run (`configure(scorer)`, which returns the scorer to use;
`check(scorer, head_dims)`, which refuses in one line what it cannot route) and every compaction
(`keep(scorer, scores, view, k)`). The base class is `native`: the scorer's own structure, unchanged
(today's behaviour, bit for bit): `keep` returns the scorer's own selection (`select`, the kept
indices `[B, G, k]` shared by all layers or `[L, B, G, k]` per layer, as `Scorer.select` does).
`shared` and `per-layer` are the two kept-set structures TriAttention and alpha score in (one kept
set per KV head for all layers, or one per (layer, KV head): `Scorer.structures`, the first its
default, which `native` keeps); they set the scorer's structure (`chooses`, `Scorer.structured`)
and are refused for a scorer with one structure of its own. A configuration records the structure as
the scorer's `routing` (`retention.policy.registry.routing_given`, `canonical_routing`: the form
configurations were written in when it was a scorer parameter, so that their hashes stand).

A routing that *allocates* implements `allocate(scores, view, k)`: how many tokens each (layer,
row, KV head) keeps, `[L, B, G]`, summing over (layer, head) to `L x G x k` in every row (the same
mean per (layer, KV head) as a uniform compaction: the budget `B` is that mean, so an allocation
redistributes it and the meter, which counts the real stored tokens, holds it). Each head keeps
the first `count` tokens of the scorer's keep order (`retention.policy.routing.allocation`), and the cache
stores heads of different lengths in its `[S, G, cap]` buffers with holes that the attention mask
hides per layer and head (`retention.runtime.cache`, "Ragged rows"). `keep` reads the counts once
per compaction (their largest and their sum per row: the rows' widths, and the check that the mean
is held); where every count is `k` it falls back to the scorer's own selection, so an allocation
that happens to be uniform decodes exactly what `native` decodes.

* `pyramidkv` (Cai et al. 2024; kvpress's `PyramidKVPress`): per-layer budgets falling linearly
  from the first layer to the last, `beta` setting the slope (`allocation.pyramid_budgets`, with
  `n` the row's mean stored tokens and the window its largest protected count per head); every head
  of a layer keeps the layer's budget. At decode time a layer may store fewer tokens than its
  budget (its last budget plus the tokens since, after a prompt that clipped the pyramid
  differently): it keeps what it has and the rest goes to the first layers with room
  (`allocation.cap_to_stored`). `beta = 1` is flat: exactly `native` (`trivial`).
* `adakv` (Feng et al. 2024; kvpress's `AdaKVPress`): per-head budgets within each layer from one
  ranking of the scores of all its heads, each head safeguarded with its best `int(k alpha)`
  (`allocation.adakv_kept`). `alpha = 1` safeguards `k` per head: exactly `native` (`trivial`).

Unlike kvpress (which compresses once, at prefill, and masks pruned AdaKV entries with a fake key),
both act at every compaction of decode-time retention and physically evict. They need per-layer
scores (`[L, B, G, n]`; a scorer with a choice of structure is set to `per-layer`) ranked by the
scorer's top-k order (a scorer with a selection of its own, such as alpha's facility location or
H2O's heavy/recent split, is refused), a per-layer K/V cache (latent and shared-store layouts are
refused), and the `full` state (the quantised and merged states count tokens per row, not per head).

Plugins subclass `Routing` (entry-point group `retention.routings`, `module:Class`, `file.py:Class`);
one that allocates subclasses `Allocating` for the refusals above and implements `allocate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.routing.allocation import keep_ranks, kept_by_counts, padded_indices
from retention.policy.scoring.base import Scorer
from retention.policy.settings import TrivialSetting
from retention.runtime.cache import Allocation


@dataclass
class Routing(TrivialSetting):
    """Base class and the `native` routing: the scorer's own kept-set structure."""

    name: ClassVar[str] = "native"
    # The kept-set structure this routing sets a scorer to (None: the scorer's default).
    structure: ClassVar[str | None] = None
    # Whether `allocate` gives (layer, KV head)s different counts (the arm then asks for per-layer
    # scores and refuses what cannot store ragged heads).
    allocates: ClassVar[bool] = False

    @classmethod
    def chooses(cls, scorer) -> str | None:
        """The kept-set structure this routing sets a scorer (class or instance) to, one of its
        `structures`; None: it leaves the scorer's own (`native`). Refuse, in one line, a scorer it
        cannot route."""
        if cls.structure is None:
            return None
        if cls.structure not in scorer.structures:
            raise RetentionError(f"routing {cls.name!r} chooses a scorer's kept-set structure (triattention, alpha); "
                                 f"scorer {scorer.name!r} has one of its own (use --routing native)")
        return cls.structure

    @classmethod
    def structure_for(cls, scorer) -> str | None:
        """The structure a fresh scorer scores in under this routing: the one it chooses, else the
        scorer's default (the first of its `structures`; None: it has one of its own)."""
        chosen = cls.chooses(scorer)
        if chosen is not None:
            return chosen
        return scorer.structures[0] if scorer.structures else None

    def configure(self, scorer):
        """The scorer this routing runs: `scorer` itself (or whatever wraps it), set to the structure
        this routing chooses (`native` leaves it as it is)."""
        structure = self.chooses(scorer)
        if structure is not None:
            scorer.structured(structure)
        return scorer

    def check(self, scorer, head_dims: tuple[int, int] | None) -> None:
        """Refuse, in one line, a scorer or a cache layout (`head_dims` None: latent or shared
        stores) this routing cannot route; called when the arm is built, before any model work."""


    def select(self, scorer, scores: torch.Tensor, view, k: int) -> torch.Tensor:
        """Kept indices for `k` tokens per (layer,) row and KV head: the scorer's own selection."""
        return scorer.select(scores, view, k)

    def allocate(self, scores: torch.Tensor, view, k: int) -> torch.Tensor | None:
        """Kept tokens per (layer, row, KV head), `[L, B, G]` int64, summing to `L x G x k` in every
        row (scores `[L, B, G, n]`); None: `k` everywhere (no allocation)."""
        return None

    def keep(self, scorer, scores: torch.Tensor, view, k: int) -> tuple[torch.Tensor, Allocation | None]:
        """What a compaction keeps: `select`'s indices and None, or, where `allocate` gives counts
        that differ, each head's first `count` tokens of the scorer's order `[L, B, G, m]` (-1 after
        them) and the `Allocation` the cache stores them with (one host read of `[B, 4]` figures)."""
        counts = self.allocate(scores, view, k)
        if counts is None:
            return self.select(scorer, scores, view, k), None
        valid, protected = torch.stack(view.valid), torch.stack(view.protected)
        L, _, G = counts.shape
        figures = torch.stack([counts.amax((0, 2)), counts.sum((0, 2)),
                               (counts > valid.sum(-1)).sum((0, 2)), (counts < protected.sum(-1)).sum((0, 2))], -1)
        rows = figures.tolist()
        widths = [r[0] for r in rows]
        if any(r[1] != L * G * k for r in rows):
            raise RetentionError(f"routing {self.name!r} allocated {[r[1] for r in rows]} tokens per row, not "
                                 f"L x G x k = {L * G * k}: an allocation must keep the uniform mean")
        if any(r[2] or r[3] for r in rows):
            raise RetentionError(f"routing {self.name!r} gave a head more tokens than it stores or fewer than "
                                 "its protected ones")
        if max(widths) == k:  # every count is k (their mean): the scorer's own selection, bit for bit
            return self.select(scorer, scores, view, k), None
        kept = kept_by_counts(keep_ranks(scores, protected, valid), counts)
        return padded_indices(kept, max(widths)), Allocation(tuple(widths), k)


@dataclass
class Allocating(Routing):
    """Base of the allocating routings: the refusals they share (module docstring)."""

    allocates: ClassVar[bool] = True

    @classmethod
    def chooses(cls, scorer) -> str | None:
        """An allocation needs one kept set per layer: `per-layer` for a scorer that offers it."""
        return "per-layer" if "per-layer" in scorer.structures else None

    def check(self, scorer, head_dims) -> None:
        if head_dims is None:
            raise RetentionError(f"routing {self.name!r} stores heads of different lengths, which needs a "
                                 "per-layer K/V cache; this model's cache is latent or shared across layers")
        if not scorer.per_layer:
            raise RetentionError(f"routing {self.name!r} allocates per layer and needs per-layer scores "
                                 f"[L, B, G, n]; scorer {type(scorer).name!r} scores once for all layers")
        if type(scorer).select is not Scorer.select:
            raise RetentionError(f"routing {self.name!r} ranks tokens by the scorer's top-k order; scorer "
                                 f"{type(scorer).name!r} selects its own way (use a top-k scorer: triattention, "
                                 "snapkv, rkv)")
