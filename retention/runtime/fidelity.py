"""The fidelity proxy: how far the retained cache's next-token distribution is from the full cache's
along the same tokens (the engine decodes them through both when `fidelity=True`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from retention.runtime.sampling import greedy


@dataclass
class Fidelity:
    """Per-step agreement of the retained cache with the full cache along the same tokens."""

    kl: list[float] = field(default_factory=list)
    top1_agree: list[bool] = field(default_factory=list)

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """ref_logits, logits: `[V]` next-token logits (full cache, retained cache); one host read."""
        kl, agree = step_agreement(ref_logits[None], logits[None])
        kl_v, agree_v = torch.cat([kl, agree.double()]).tolist()
        self.kl.append(kl_v)
        self.top1_agree.append(bool(agree_v))

    def summary(self) -> dict:
        n = len(self.kl)
        first = next((i for i, a in enumerate(self.top1_agree) if not a), None)
        return {
            "kl_mean": sum(self.kl) / n if n else 0.0,
            "kl_max": max(self.kl) if n else 0.0,
            "top1_agreement": sum(self.top1_agree) / n if n else 1.0,
            "first_divergence_step": first,
            "steps": n,
        }


def step_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(p_ref || p) `[R]` in float64 (clamped at 0) and top-1 agreement `[R]` (bool) per row of
    `[R, V]` logits, on the device (nothing read on the host)."""
    p_log = torch.log_softmax(ref_logits.double(), -1)
    q_log = torch.log_softmax(logits.double(), -1)
    # sum p (log p - log q), the same figures as written out, in one fused kernel
    kl = torch.nn.functional.kl_div(q_log, p_log, reduction="none", log_target=True).sum(-1).clamp(min=0.0)
    return kl, greedy(ref_logits) == greedy(logits)
