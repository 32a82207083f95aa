"""TriAttention's frequency-domain pieces shared by its per-head score (`retention.policy.scoring.triattention`)
and its latent score (`retention.policy.scoring.latent`): the future offsets, the mean future phase per
RoPE band, and the per-row standardisation of the aggregation. Shapes as in those modules.
"""

from __future__ import annotations

import torch

# The geometric future offsets D = {1, 2, 4, ..., 2^16}: 17 values.
OFFSETS = tuple(2**i for i in range(17))
STD_FLOOR = 1e-6


def future_phase(inv_freq: torch.Tensor, t: int, offsets=OFFSETS) -> torch.Tensor:
    """`mean_{d in D} exp(i w_f (t + d))` `[F]` complex128, from inverse frequencies `[F]`."""
    w = inv_freq.double()
    ang = w[:, None] * (float(t) + torch.tensor(offsets, dtype=torch.float64, device=w.device))[None, :]
    return torch.polar(torch.ones_like(ang), ang).mean(-1)


def zscore_rows(raw: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """raw `[..., n]`, candidates `[..., n]` bool (broadcastable) -> `[..., n]`: each row standardised
    over its candidates (mean and population std, the std floored at 1e-6). Values at
    non-candidates (protected tokens, padding) are meaningless: callers mask them."""
    c = candidates.to(raw.dtype)
    cnt = c.sum(-1, keepdim=True).clamp(min=1)
    mean = (raw * c).sum(-1, keepdim=True) / cnt
    var = (((raw - mean) ** 2) * c).sum(-1, keepdim=True) / cnt
    return (raw - mean) / var.sqrt().clamp(min=STD_FLOOR)


def zscore_group_max(raw: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """raw `[B, G, r, n]`, candidates `[B, G, n]` bool -> `[B, G, n]`: each (head) row z-scored over
    its candidates (`zscore_rows`), then the max over the group's `r` query heads."""
    return zscore_rows(raw, candidates[:, :, None, :]).amax(dim=2)
