"""`streaming` (StreamingLLM, Xiao et al. 2023): `sink` first tokens plus the most recent ones."""

from dataclasses import dataclass
from typing import ClassVar

from retention.policy.scoring.base import Scorer


@dataclass
class Streaming(Scorer):
    name: ClassVar[str] = "streaming"
    batch_prefill: ClassVar[bool] = True  # reads no query or attention of the forward
    default_sink = 4

    def score(self, view):
        """Score = absolute position `[B, G, n]`: top-k keeps the newest; sinks are protected."""
        return view.positions[0].float().masked_fill(~view.valid[0], float("-inf"))
