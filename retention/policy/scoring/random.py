"""`random`: keep a seeded uniformly random subset (protected tokens kept): the floor to beat.

On the per-layer K/V layout of a transformers model one draw is shared by every layer; on a
reference layout model each eviction (sharing) group draws its own subset, group after group."""

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.policy.scoring.base import Scorer, topk_keep


@dataclass
class RandomScorer(Scorer):
    name: ClassVar[str] = "random"
    batch_prefill: ClassVar[bool] = True  # reads no query or attention of the forward
    seed: int = 0
    _gens: dict = field(default_factory=dict, init=False, repr=False)  # slot -> torch.Generator

    def reset_slot(self, slot: int, seed: int) -> None:
        """Each sequence draws from its own generator, seeded with its (problem, sample) seed combined
        with the scorer's own `seed` (XOR: either alone when the other is 0)."""
        self._gens[slot] = torch.Generator().manual_seed(seed ^ self.seed)

    def _draw(self, view, g: int) -> torch.Tensor:
        """Uniform scores `[B, G, n]` of group `g`, row `b` from its slot's generator (padding -inf)."""
        p = view.positions[g]
        rows = []
        for slot in view.slots.tolist():
            if slot not in self._gens:
                self._gens[slot] = torch.Generator().manual_seed(self.seed)
            rows.append(torch.rand(p.shape[1:3], generator=self._gens[slot]))
        return torch.stack(rows).to(p.device).masked_fill(~view.valid[g], float("-inf"))

    def score(self, view):
        """`[B, G, n]` (one draw for all layers), or `[L, B, G, n]` on a layout model (one per group)."""
        if view.layout is None:
            return self._draw(view, 0)
        return torch.stack([self._draw(view, g) for g in range(view.num_layers)])

    def select(self, scores, view, k):
        if scores.dim() == 4:
            return topk_keep(scores, torch.stack(view.protected), k, torch.stack(view.valid))
        return super().select(scores, view, k)
