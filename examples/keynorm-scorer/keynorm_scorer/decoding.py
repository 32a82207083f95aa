"""max-run: a decoding plugin (another family than scoring) that forbids runs of one token."""

from dataclasses import dataclass

import torch

from retention.policy.decoding import Decoding


@dataclass
class MaxRun(Decoding):
    """Ban the token that would make a run of more than `run` identical tokens in a row."""

    name = "max-run"
    run: int = 4

    def adjust(self, logits: torch.Tensor, rows: list[int], histories: list[list[int]]) -> torch.Tensor:
        # logits [R, V]; histories[r] holds row r's generated tokens (host ints: no device read).
        bans = [(r, h[-1]) for r, h in enumerate(histories) if len(h) >= self.run and len(set(h[-self.run:])) == 1]
        if not bans:
            return logits
        out = logits.clone()
        out[torch.tensor([r for r, _ in bans]), torch.tensor([t for _, t in bans])] = float("-inf")
        return out

    @classmethod
    def trivial(cls):
        return {"run": 1 << 30}  # no run is that long: nothing is banned
