"""keynorm: keep the keys of largest L2 norm (averaged over layers). A retention scorer plugin."""

from dataclasses import dataclass

import torch

from retention.scorers import CacheView, Scorer


@dataclass
class KeyNorm(Scorer):
    """Score of a cached token = mean over layers of ||key||^power, per KV head; higher is kept.

    One kept set per (sequence, KV head) shared by all layers: `score` returns `[B, G, n]`.
    """

    name = "keynorm"
    reads = (frozenset({"keys"}),)  # per-head keys: `retention run` refuses models that do not provide them
    default_sink = 4  # the first tokens act as attention sinks: protect them by default
    power: float = 1.0

    def __post_init__(self):
        if not self.power > 0:
            raise ValueError(f"power must be > 0, got {self.power}")

    def score(self, view: CacheView) -> torch.Tensor:
        norms = torch.stack([k.norm(dim=-1) for k in view.keys]).mean(0)  # [L, B, G, n] -> [B, G, n]
        return (norms ** self.power).masked_fill(~view.valid[0], float("-inf"))  # padding never kept
