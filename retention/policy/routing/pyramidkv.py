"""The `pyramidkv` routing: per-layer budgets falling linearly over the layers (`retention.policy.routing.base`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.routing.allocation import cap_to_stored, pyramid_budgets
from retention.policy.routing.base import Allocating


@dataclass
class PyramidKV(Allocating):
    """PyramidKV's layer budgets (module docstring). `beta` >= 1: the pyramid's top-to-bottom ratio."""

    name: ClassVar[str] = "pyramidkv"
    beta: float = 20.0  # kvpress's default

    def __post_init__(self):
        if not (self.beta >= 1 and self.beta != float("inf")):
            raise RetentionError(f"pyramidkv.beta must be a finite number >= 1, got {self.beta}")

    @classmethod
    def trivial(cls) -> dict | None:
        return {"beta": 1.0}  # min = max = keep: a flat pyramid

    def allocate(self, scores, view, k) -> torch.Tensor:
        valid = torch.stack(view.valid)  # [L, B, G, n]
        L, B, G, _ = valid.shape
        n = valid.sum(-1).double().mean((0, 2))  # [B] the row's mean stored tokens
        window = torch.stack(view.protected).sum(-1).amax((0, 2)).double()  # [B] most protected in a head
        budgets = pyramid_budgets(n, torch.full_like(n, float(k)), L, self.beta, window)  # [L, B]
        return cap_to_stored(budgets[:, :, None].expand(L, B, G), valid.sum(-1))
