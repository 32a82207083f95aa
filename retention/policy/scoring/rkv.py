"""`rkv`: R-KV, SnapKV importance mixed with key redundancy: `lam * I - (1 - lam) * R`.

Shapes: layers `L`, batch `B`, KV heads `G`, stored tokens (slots) `n`, head dim `d`.

Per layer and KV head; the candidates are every stored token except the `window` newest (whose
queries form the observation window and which are always kept, as in `snapkv`):

* `I[j]`: the SnapKV importance of `retention.policy.scoring.snapkv` (window queries, max over the group's
  query heads, softmax over the candidates, mean over the window, max-pool kernel 7).
* `R[j]`, redundancy, as the reference `cal_similarity` computes it, over **all** stored slots
  (window included) and only then restricted to the candidates:

      S[i, j] = cos(k_i, k_j),  k / (|k| + 1e-8),  0 on the diagonal
      m(i)    = the largest slot j with S[i, j] > 0.5 (in position-ordered storage: the newest
                near-duplicate of token i); if there is none, m(i) = 0 (a reference quirk: slot 0
                loses the similarity of every row without a partner)
      S[i, m(i)] := 0
      R[j]    = softmax over all stored j of  (1 / n) * sum over all stored i of S[i, j]

  So the newest copy of repeated content collects none of its near-duplicates' similarity and
  looks non-redundant, while older copies look redundant ("retain the last").

Score `lam * I - (1 - lam) * R` at the candidates (default `lam = 0.1`, the R-KV README's value; its
code defaults to 0.07, see docs/scorers.md), window tokens +inf; top-`(b - w)` per (layer, KV head)
plus the window. Reference defaults: window 8, kernel 7, interval 128.
"""

from __future__ import annotations

from typing import ClassVar
from dataclasses import dataclass

import torch

from retention.runtime.cache import CacheView
from retention.errors import RetentionError
from retention.policy.scoring.snapkv import SnapKV


def key_redundancy(keys: torch.Tensor, valid: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """R of one layer (module doc) over every valid slot, window included.

    keys `[B, G, n, d]`, valid `[B, G, n]` bool (False on padding, which must follow the stored
    slots) -> `[B, G, n]` float32, a distribution over the valid slots (0 on padding). Callers take
    the candidates' entries (`rkv_scores`).
    """
    n = keys.shape[2]
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.transpose(-1, -2)  # [B, G, n, n]
    eye = torch.eye(n, dtype=torch.bool, device=keys.device)
    pair = valid[..., :, None] & valid[..., None, :]
    sim = sim.masked_fill(~pair | eye, 0.0)
    # Each row's largest partner slot (-1: none), then the reference's fallback to slot 0.
    slots = torch.arange(n, device=keys.device)
    partner = torch.where(sim > threshold, slots, -1).amax(dim=-1, keepdim=True).clamp(min=0)  # [B, G, n, 1]
    sim = sim.masked_fill(slots == partner, 0.0)
    count = valid.sum(-1, keepdim=True).clamp(min=1).float()
    colmean = sim.sum(dim=-2) / count  # [B, G, n]: the zeroed diagonal counts in the divisor
    return torch.softmax(colmean.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num_(0.0)


def rkv_scores(importance: torch.Tensor, redundancy: torch.Tensor, candidates: torch.Tensor,
               lam: float) -> torch.Tensor:
    """`lam * I - (1 - lam) * R` at the candidates, -inf elsewhere. All `[B, G, n]`."""
    return (lam * importance - (1.0 - lam) * redundancy).masked_fill(~candidates, float("-inf"))


@dataclass
class RKV(SnapKV):
    """R-KV. Parameters: `lam` (importance weight, default 0.1), `window` (default 8), `kernel`
    (default 7), `threshold` (near-duplicate cosine, default 0.5)."""

    name: ClassVar[str] = "rkv"

    reads = (frozenset({"queries", "keys"}),)
    lam: float = 0.1
    threshold: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if self.rule not in (None, "head"):
            raise RetentionError("rkv scores per-head keys: its SnapKV importance uses the head rule only")
        if not (0.0 <= self.lam <= 1.0):
            raise RetentionError(f"--lambda for rkv must lie in [0, 1], got {self.lam}")

    def reading(self):
        return self.reads

    def attach(self, model):
        self._rule = "head"
        return self._attached(model)

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: `lam * I - (1 - lam) * R`, +inf on the window tokens, -inf on padding."""
        out = []
        for l in range(view.num_layers):
            win = self.window_mask(view, l)
            valid = view.valid[l]
            red = key_redundancy(view.keys[l], valid, self.threshold)
            out.append(rkv_scores(self.importance(view, l), red, ~win & valid, self.lam)
                       .masked_fill(win & valid, float("inf")))
        return torch.stack(out)
