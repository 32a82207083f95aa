"""`random-pp`: Random Attention's control (arXiv 2609.03430, `random_pp` in its code) as one preset.

The prompt protected and counted inside b (at most b - recent - 1 prompt tokens, the reference's
`min(prompt_len, K - 1)`), a recency window of 64 tokens that is also the compaction interval (the
reference's `residual_length`), and a uniformly random subset of the other tokens, drawn
independently for every layer and KV head (the reference draws one `torch.rand` per layer). The
conventions and where this differs from the reference: docs/random-control.md.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.policy.scoring.random import RandomScorer

# The reference's residual_length (scripts/run_cell.sh: --residual_length 64).
REFERENCE_WINDOW = 64


@dataclass
class RandomPP(RandomScorer):
    name: ClassVar[str] = "random-pp"
    per_layer: ClassVar[bool] = True
    default_recent: ClassVar[int] = REFERENCE_WINDOW
    default_interval: ClassVar[int | None] = REFERENCE_WINDOW
    default_prompt: ClassVar[str] = "keep"

    def score(self, view):
        """`[L, B, G, n]` uniform scores, one independent draw per (layer, KV head) of each row, each
        row from its own sequence's generator (padding -inf). On a layout model: one per group."""
        if view.layout is not None:
            return super().score(view)
        valid = torch.stack(view.valid)  # [L, B, G, n]
        L, _, G, n = valid.shape
        # Each row draws over its own width (its last valid slot + 1), not the view's padded one, so
        # that its draws do not depend on the other rows of the view (batch invariance).
        width = (valid.any(0).any(1) * torch.arange(1, n + 1, device=valid.device)).amax(-1).tolist()  # [B]
        rows = []
        for slot, w in zip(view.slots.tolist(), width):
            if slot not in self._gens:
                self._gens[slot] = torch.Generator().manual_seed(self.seed)
            rows.append(torch.nn.functional.pad(torch.rand((L, G, w), generator=self._gens[slot]), (0, n - w)))
        return torch.stack(rows, dim=1).to(valid.device).masked_fill(~valid, float("-inf"))
