"""The `adakv` routing: per-head budgets within each layer (`retention.policy.routing.base`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.routing.allocation import adakv_kept, safeguard_size
from retention.policy.routing.base import Allocating


@dataclass
class AdaKV(Allocating):
    """AdaKV's head budgets (module docstring). `alpha` in [0, 1]: the safeguard's share of `k`."""

    name: ClassVar[str] = "adakv"
    alpha: float = 0.2  # kvpress's alpha_safeguard default

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise RetentionError(f"adakv.alpha must be in [0, 1], got {self.alpha}")

    @classmethod
    def trivial(cls) -> dict | None:
        return {"alpha": 1.0}  # each head safeguards its best k: the per-head top-k

    def allocate(self, scores, view, k) -> torch.Tensor:
        kept, _ = adakv_kept(scores, torch.stack(view.protected), torch.stack(view.valid), k,
                             safeguard_size(k, self.alpha))
        return kept.sum(-1)
