"""`rkv`: R-KV, SnapKV importance mixed with key redundancy: `lam * I - (1 - lam) * R`.

Shapes: layers `L`, batch `B`, KV heads `G`, stored tokens `n`, head dim `d`.

Per layer and KV head, over the candidates (every stored token except the `window` newest, whose
queries form the observation window and which are always kept, as in `snapkv`):

* `I[j]`: the SnapKV importance of `retention.scorers.snapkv` (window queries, max over the group's
  query heads, softmax over candidates, mean over the window, max-pool kernel 7).
* `R[j]`, redundancy. This project's reading of the spec line ("softmax over tokens of the
  column-mean key cosine similarity with each token's most recent near-duplicate (cos > 0.5) not
  counted"), stated exactly:

      S[i, j] = cos(k_i, k_j) for candidates i != j, 0 on the diagonal
      m(i)    = the most recent candidate j != i (highest absolute position) with S[i, j] > 0.5,
                if any: token i's most recent near-duplicate
      S[i, m(i)] := 0          (that one similarity is not counted)
      R[j]    = softmax over candidates j of  (1 / n_c) * sum over candidates i of S[i, j]

  So a token that is the most recent copy of its near-duplicates collects none of their similarity
  and looks non-redundant, while older copies look redundant: among repeated content, R-KV keeps the
  newest ("retain the last"). The threshold is strict (`>`), the mean divides by the number of
  candidates `n_c` (diagonal included as 0), the keys are the stored post-RoPE keys.

Score `lam * I - (1 - lam) * R` (default `lam = 0.1`), window tokens +inf; top-`(b - w)` per
(layer, KV head) plus the window. Reference defaults: window 8, kernel 7, interval 128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retention.cache import CacheView
from retention.errors import RetentionError
from retention.scorers import register
from retention.scorers.snapkv import SnapKV


def key_redundancy(keys: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor,
                   threshold: float = 0.5) -> torch.Tensor:
    """R of one layer (module doc): keys `[B, G, n, d]`, positions `[B, G, n]`, candidates `[B, G, n]`
    bool -> `[B, G, n]` float32, a distribution over the candidates (0 elsewhere)."""
    n = keys.shape[2]
    k = F.normalize(keys.float(), dim=-1, eps=1e-8)
    sim = k @ k.transpose(-1, -2)  # [B, G, n, n]
    eye = torch.eye(n, dtype=torch.bool, device=keys.device)
    valid = candidates[..., :, None] & candidates[..., None, :] & ~eye
    sim = sim.masked_fill(~valid, 0.0)
    near = valid & (sim > threshold)
    # Each row's most recent near-duplicate: the highest position among its near-duplicates.
    pos = positions[..., None, :].expand_as(sim)
    latest = torch.where(near, pos, -1).amax(dim=-1, keepdim=True)  # [B, G, n, 1]; -1: none
    sim = sim.masked_fill(near & (pos == latest), 0.0)
    n_c = candidates.sum(-1, keepdim=True).clamp(min=1).float()
    colmean = sim.sum(dim=-2) / n_c  # [B, G, n]: mean over rows i of column j
    return torch.softmax(colmean.masked_fill(~candidates, float("-inf")), dim=-1).nan_to_num_(0.0)


@register("rkv")
@dataclass
class RKV(SnapKV):
    """R-KV. Parameters: `lam` (importance weight, default 0.1), `window` (default 8), `kernel`
    (default 7), `threshold` (near-duplicate cosine, default 0.5)."""

    lam: float = 0.1
    threshold: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not (0.0 <= self.lam <= 1.0):
            raise RetentionError(f"--lambda for rkv must lie in [0, 1], got {self.lam}")

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: `lam * I - (1 - lam) * R`, +inf on the window tokens, -inf on padding."""
        out = []
        for l in range(view.num_layers):
            win = self.window_mask(view, l)
            imp = self.importance(view, l)
            red = key_redundancy(view.keys[l], view.positions[l], ~win & view.valid[l], self.threshold)
            out.append((self.lam * imp - (1.0 - self.lam) * red).masked_fill(win, float("inf"))
                       .masked_fill(~view.valid[l], float("-inf")))
        return torch.stack(out)
