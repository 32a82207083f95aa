"""`random`: keep a seeded uniformly random subset (protected tokens kept): the floor to beat."""

from dataclasses import dataclass, field

import torch

from retention.scorers import register
from retention.scorers.base import Scorer


@register("random")
@dataclass
class RandomScorer(Scorer):
    seed: int = 0
    _gens: dict = field(default_factory=dict, init=False, repr=False)  # slot -> torch.Generator

    def reset_slot(self, slot: int, seed: int) -> None:
        """Each sequence draws from its own generator, seeded with its (problem, sample) seed combined
        with the scorer's own `seed` (XOR: either alone when the other is 0)."""
        self._gens[slot] = torch.Generator().manual_seed(seed ^ self.seed)

    def score(self, view):
        """Uniform random scores `[B, G, n]`, row `b` from its slot's generator (padding -inf)."""
        k = view.keys[0]
        rows = []
        for slot in view.slots.tolist():
            if slot not in self._gens:
                self._gens[slot] = torch.Generator().manual_seed(self.seed)
            rows.append(torch.rand(k.shape[1:3], generator=self._gens[slot]))
        return torch.stack(rows).to(k.device).masked_fill(~view.valid[0], float("-inf"))
