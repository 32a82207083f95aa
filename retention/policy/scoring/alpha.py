"""`alpha`: TriAttention scores, facility-location selection with V-signatures.

Only the selection step differs from `triattention` (same scores, cadence and cache).

V-signature of a token: the mean of its value vectors over all `L` layers and all `G` KV heads,
L2-normalised (`u`, `[d]`). It is computed once, when the token is written (then every (layer, KV
head) holds it, `token_signatures`), and carried with the token: a per-slot buffer (`[B, G, n, d]`,
or `[L, B, G, n, d]` with per-layer routing; about `1/L` of the values) is gathered with the same
kept indices as the cache at every compaction. So a token's signature never depends on which of its
copies later evictions left behind, and old and new tokens are compared on the same footing.

Greedy selection per KV head (and per layer with `--routing per-layer`), vectorised over batch and
heads. The selected set starts with the protected tokens (they enter first, in index order, and add
their cosine rows like any pick); each further pick, up to `k` kept tokens, adds the candidate maximising

    score[j] - lam * pen[j],    pen[j] = max over selected i with cos(u_j, u_i) >= radius of cos(u_j, u_i)

(`pen = 0` while no selected token is within `radius`, in particular for the empty set: the very
first token to enter is never penalised). `pen` is kept up to date incrementally: each pick computes
one row of the cosine matrix (`[..., n]`) and takes an elementwise max. Ties go to the lowest index
(`argmax` returns the first maximum), the same rule as `topk_keep`'s stable sort, so at `lam = 0`
the kept indices, sorted ascending, are bit-for-bit those of the top-k baseline.

On an MLA latent cache (`retention.policy.scoring.latent`) the scores are the latent TriAttention's and a
token's signature is the same mean over layers and heads, formed from its latents through each
layer's head-mean value up-projection (`latent_value_signatures`, exact), when the token is written,
and carried as the same per-token state (`[S, 1, cap, d_v]`: one eviction head per MLA layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from retention.runtime.cache import CacheView
from retention.errors import RetentionError
from retention.policy.scoring.triattention import TriAttention


def token_signatures(values) -> torch.Tensor:
    """V-signatures of freshly written tokens.

    values: `L` tensors `[B, G, q, d]`, the value vectors of the `q` newest tokens in every layer
    (every KV head of every layer holds a token when it is written). Returns `[B, q, d]` float32,
    the mean over the `L * G` vectors, L2-normalised (a zero mean stays zero: cosine 0 to all).
    """
    mean = torch.stack([v.float() for v in values]).mean(dim=(0, 2))
    return F.normalize(mean, dim=-1)


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


@dataclass
class Alpha(TriAttention):
    """TriAttention scores with facility-location selection. Parameters: `lam` (redundancy weight,
    default 0.5), `radius` (cosine below which no penalty applies, default 0), plus `stats` as for
    `triattention`, and its two kept-set structures. Protects nothing by default."""

    name: ClassVar[str] = "alpha"
    batch_prefill: ClassVar[bool] = True  # its observe reads the values each row stored (`written_slots`)

    # Per-head keys and values, or an MLA latent (with the model's up-projections), and the statistics.
    reads: ClassVar[tuple[frozenset[str], ...]] = (frozenset({"keys", "values", "calibration"}),
                                                  frozenset({"latent", "calibration"}))

    lam: float = 0.5
    radius: float = 0.0

    # Per-token state in the cache (`RetentionCache.add_extra`): `[S, G, cap, d]` float32 unit
    # signatures, in layer 0 (shared routing) or in every layer (per-layer routing). The cache
    # gathers it with the keys at every compaction, row move and slot refill.
    EXTRA = "alpha_sig"

    def __post_init__(self):
        if not (self.lam >= 0 and self.lam != float("inf")):
            raise RetentionError(f"--lambda must be a finite number >= 0, got {self.lam}")
        if not -1.0 <= self.radius <= 1.0:  # a cosine: outside [-1, 1] it silently means "never" or "always"
            raise RetentionError(f"--radius is a cosine and must be in [-1, 1], got {self.radius}")

    def observe(self, cache, next_position) -> None:
        """Write the signature of every token the last forward wrote (all layers and KV heads hold
        it now) into the per-token buffer, at that token's slot in every KV head (on a latent cache:
        from its latents, `LatentScoring.write_signatures`)."""
        super().observe(cache, next_position)
        if self._latent is not None:
            self._latent.write_signatures(cache, self.EXTRA, self.per_layer)
            return
        idx = cache.written_slots()  # [S, q]
        S, q = idx.shape
        G = cache.layers[0].pbuf.shape[1]
        tidx = idx[:, None, :].expand(S, G, q)
        u = token_signatures([cache.token_values(i, tidx) for i in range(len(cache.layers))])  # [S, q, d]
        d = u.shape[-1]
        gidx = tidx[..., None].expand(S, G, q, d)
        u = u[:, None].expand(S, G, q, d)
        for layer in range(len(cache.layers)) if self.per_layer else (0,):
            cache.add_extra(layer, self.EXTRA, (d,)).scatter_(2, gidx, u)

    def signatures(self, view: CacheView) -> torch.Tensor:
        """The view's signatures: `[B, G, n, d]` (shared) or `[L, B, G, n, d]` (per layer); `G = 1`
        and `d = d_v` on a latent cache."""
        if not view.extra or self.EXTRA not in view.extra[0]:
            raise RuntimeError("alpha: no V-signatures in the cache (observe() not called after a forward?)")
        if self.per_layer:
            return torch.stack([x[self.EXTRA] for x in view.extra])
        return view.extra[0][self.EXTRA]

    def select(self, scores: torch.Tensor, view: CacheView, k: int) -> torch.Tensor:
        """Kept indices `[B, G, k]` (shared) or `[L, B, G, k]` (per layer), sorted ascending."""
        protected = torch.stack(view.protected) if self.per_layer else view.protected[0]
        return facility_location_keep(scores, self.signatures(view), protected, k, self.lam, self.radius)
