"""`alpha`: TriAttention scores, facility-location selection with V-signatures.

Only the selection step differs from `triattention` (same scores, cadence and cache).

V-signature of a token: the mean of its value vectors over all layers and all KV heads holding it,
L2-normalised (`u`, `[d]`). Before any eviction every (layer, KV head) holds every token, so this is
the plain mean over all `L * G` value vectors; once KV heads (or, with per-layer routing, layers)
keep different tokens, a token's signature averages the copies that are still stored, identified by
absolute position, so a stored slot always gets the signature of the token it holds.

Greedy selection per KV head (and per layer with `routing="per-layer"`), vectorised over batch and
heads. The selected set starts with the protected tokens (they enter first, in index order, and add
their cosine rows like any pick); each further pick, up to `k` kept tokens, adds the candidate maximising

    score[j] - lam * pen[j],    pen[j] = max over selected i with cos(u_j, u_i) >= radius of cos(u_j, u_i)

(`pen = 0` while no selected token is within `radius`, in particular for the empty set: the very
first token to enter is never penalised). `pen` is kept up to date incrementally: each pick computes
one row of the cosine matrix (`[..., n]`) and takes an elementwise max. Ties go to the lowest index
(`argmax` returns the first maximum), the same rule as `topk_keep`'s stable sort, so at `lam = 0`
the kept indices, sorted ascending, are bit-for-bit those of the top-k baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retention.cache import CacheView
from retention.errors import RetentionError
from retention.scorers import register
from retention.scorers.triattention import TriAttention


def v_signatures(view: CacheView, per_layer: bool) -> torch.Tensor:
    """Unit V-signatures of the stored tokens: `[B, G, n, d]` (indexed like layer 0's slots; with
    shared routing every layer stores the same tokens per KV head) or `[L, B, G, n, d]` per layer.

    A token's signature is the mean of all stored value vectors with its absolute position, over
    all layers and KV heads, computed with one scatter-add per layer into a `[B, t, d]` table.
    """
    B, _, _, d = view.values[0].shape
    dev = view.values[0].device
    t = max(int(view.next_position.max()), max(int(p.max()) + 1 for p in view.positions))
    # Padding (position -1) goes to an extra column `t` that no stored token reads.
    total = torch.zeros(B, t + 1, d, dtype=torch.float32, device=dev)
    count = torch.zeros(B, t + 1, dtype=torch.float32, device=dev)
    for v, p in zip(view.values, view.positions):
        flat = p.masked_fill(p < 0, t).reshape(B, -1)
        total.scatter_add_(1, flat[..., None].expand(-1, -1, d), v.float().reshape(B, -1, d))
        count.scatter_add_(1, flat, torch.ones_like(flat, dtype=torch.float32))
    u = F.normalize(total / count.clamp(min=1)[..., None], dim=-1)  # zero vectors stay zero: cos 0
    layers = view.positions if per_layer else view.positions[:1]
    out = [torch.gather(u, 1, p.masked_fill(p < 0, t).reshape(B, -1, 1).expand(-1, -1, d)).reshape(*p.shape, d)
           for p in layers]
    return torch.stack(out) if per_layer else out[0]


def facility_location_keep(scores: torch.Tensor, signatures: torch.Tensor, protected: torch.Tensor, k: int,
                           lam: float, radius: float = 0.0) -> torch.Tensor:
    """Greedy facility-location selection (see module doc).

    scores `[..., n]`, signatures `[..., n, d]` (unit rows), protected `[..., n]` bool, `k <= n`.
    Returns kept indices `[..., k]` int64 sorted ascending. The loop runs over the `k` picks only.
    """
    s = scores.float()
    u = signatures.float()
    lead, n = s.shape[:-1], s.shape[-1]
    k = min(k, n)
    selected = torch.zeros_like(s, dtype=torch.bool)
    # -inf = no selected token within the radius yet (pen 0).
    pen = torch.full_like(s, float("-inf"))
    forced = protected.clone()  # protected tokens not picked yet: objective +inf, so they go first
    picks = torch.empty(*lead, k, dtype=torch.long, device=s.device)
    for step in range(k):
        # lam * 0 subtracts exactly 0.0, so at lam = 0 the objective is the score bit for bit.
        obj = s - lam * torch.where(torch.isinf(pen), 0.0, pen)
        obj = obj.masked_fill(forced, float("inf")).masked_fill(selected, float("-inf"))
        pick = obj.argmax(-1, keepdim=True)  # first maximum: ties go to the lower index
        # When every remaining objective is -inf, argmax may land on a selected slot: take the first
        # unselected one instead (what a stable sort does with -inf ties).
        taken = selected.gather(-1, pick)
        if bool(taken.any()):
            pick = torch.where(taken, (~selected).to(torch.uint8).argmax(-1, keepdim=True), pick)
        selected.scatter_(-1, pick, True)
        forced.scatter_(-1, pick, False)
        picks[..., step] = pick[..., 0]
        # One row of the cosine matrix: cos(u_j, u_pick) for every j.
        row = (u @ u.gather(-2, pick[..., None].expand(*lead, 1, u.shape[-1])).transpose(-1, -2))[..., 0]
        pen = torch.maximum(pen, row.masked_fill(row < radius, float("-inf")))
    return torch.sort(picks, dim=-1).values


@register("alpha")
@dataclass
class Alpha(TriAttention):
    """TriAttention scores with facility-location selection. Parameters: `lam` (redundancy weight,
    default 0.5), `radius` (cosine below which no penalty applies, default 0), plus `stats` and
    `routing` as for `triattention`. Protects nothing by default."""

    lam: float = 0.5
    radius: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not (self.lam >= 0 and self.lam != float("inf")):
            raise RetentionError(f"--lambda must be a finite number >= 0, got {self.lam}")
        if self.radius != self.radius:
            raise RetentionError("--radius must be a number")

    def select(self, scores: torch.Tensor, view: CacheView, k: int) -> torch.Tensor:
        """Kept indices `[B, G, k]` (shared) or `[L, B, G, k]` (per layer), sorted ascending."""
        protected = torch.stack(view.protected) if self.per_layer else view.protected[0]
        sig = v_signatures(view, self.per_layer)
        return facility_location_keep(scores, sig, protected, k, self.lam, self.radius)
