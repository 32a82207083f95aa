"""`random`: keep a seeded uniformly random subset (protected tokens kept): the floor to beat."""

from dataclasses import dataclass, field

import torch

from retention.scorers import register
from retention.scorers.base import Scorer


@register("random")
@dataclass
class RandomScorer(Scorer):
    seed: int = 0
    _gen: torch.Generator | None = field(default=None, init=False, repr=False)

    def score(self, view):
        """Uniform random scores `[B, G, n]` from a generator seeded once per generation."""
        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.seed)
        k = view.keys[0]
        return torch.rand(k.shape[:3], generator=self._gen).to(k.device)
