"""The routing family: which kept set each layer follows (and, for a routing that allocates, how the
budget is split over layers and heads).

A routing sees the scorer before the run (`configure(scorer)`, which returns the scorer to use) and
every selection (`select(scorer, scores, view, k)`, returning the kept indices `[B, G, k]` shared by
all layers or `[L, B, G, k]` per layer, as `Scorer.select` does). The base class is `native`: the
scorer's own structure, unchanged (today's behaviour, bit for bit). `shared` and `per-layer` are the
two structures TriAttention and alpha offer (one kept set per KV head for all layers, or one per
(layer, KV head)); they set the scorer's `routing` parameter and are refused for a scorer without one.

The cache keeps the same number of tokens in every (layer, KV head) of a row, so a routing chooses
*which* tokens each layer keeps, not how many: allocations that give layers or heads different
counts (PyramidKV, AdaKV) need per-layer and per-head lengths in the cache and are not built yet
(`docs/design-space.md`).

Plugins subclass `Routing` (entry-point group `retention.routings`, `module:Class`, `file.py:Class`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.errors import RetentionError


@dataclass
class Routing:
    """Base class and the `native` routing: the scorer's own kept-set structure."""

    name: ClassVar[str] = "native"
    # The value this routing gives a scorer's `routing` parameter (None: leave the scorer as it is).
    structure: ClassVar[str | None] = None

    def configure(self, scorer):
        """The scorer this routing runs (refuse, in one line, one it cannot route)."""
        if self.structure is None:
            return scorer
        if "routing" not in {f.name for f in dataclasses.fields(scorer)}:
            raise RetentionError(f"routing {self.name!r} needs a scorer with a routing parameter (triattention, "
                                 f"alpha); {type(scorer).name!r} has none (use --routing native)")
        return dataclasses.replace(scorer, routing=self.structure)

    @classmethod
    def trivial(cls) -> dict | None:
        """Parameters under which this routing must behave exactly as `native` (checked), or None."""
        return None

    def select(self, scorer, scores: torch.Tensor, view, k: int) -> torch.Tensor:
        """Kept indices for `k` tokens per (layer,) row and KV head: the scorer's own selection."""
        return scorer.select(scores, view, k)

    def allocation(self, view, k: int) -> torch.Tensor | None:
        """Tokens this routing gave each (cache group,) row and KV head at its last `select`,
        `[Lc, B, G]` or `[1, B, G]` for all groups, for a routing that allocates (read by a `--trace`
        run's tracer). None: every (layer, head) keeps `k` (every routing built so far)."""
        return None


@dataclass
class Shared(Routing):
    name: ClassVar[str] = "shared"
    structure: ClassVar[str | None] = "shared"


@dataclass
class PerLayer(Routing):
    name: ClassVar[str] = "per-layer"
    structure: ClassVar[str | None] = "per-layer"
