"""`triattention`: query-free top-k from pre-RoPE query statistics (the baseline of the alpha study).

Shapes: layers `L`, batch `B`, KV heads `G`, query heads `Hq = G * r` (query head `h` reads KV head
`h // r`, transformers' `repeat_kv` order), stored tokens `n`, head dim `d`, bands `F = d / 2`.

Score of stored token `j` for query head `h` of layer `l`, with post-RoPE key bands
`k_{j,f} = k_j[f] + i k_j[f+F]`, calibrated `Qm`, `Qa` (see `retention.policy.scoring.calibration`), rotary
frequencies `w_f` and the next query position `t`:

    A_{j,f}  = Qm[l,h,f] * conj(k_{j,f})
    trig(j)  = mean_{d in D} sum_f Re(A_{j,f} * exp(i w_f (t + d)))        D = {1, 2, 4, ..., 2^16}
    norm(j)  = sum_f (Qa[l,h,f] - |Qm[l,h,f]|) * |k_{j,f}|
    s(l,h,j) = trig(j) + norm(j)

Because the mean over `D` does not depend on `j`, `trig(j) = Re(sum_f W_f conj(k_{j,f}))` with
`W_f = Qm_f * mean_d exp(i w_f (t+d))`, i.e. a dot product of the raw key with `[Re W, Im W]`; the
norm term is a dot product of the band moduli with `Qa - |Qm|`. So one layer costs two small matmuls,
with no RoPE inversion (the stored key already carries `exp(i w_f p_j)`, and the query at `t + d`
would carry `exp(i w_f (t+d))`). `rope_inverted_head_scores` computes the same score the long way
(un-rotate keys to pre-RoPE, then the relative-phase formula); a test proves both equal.

Aggregation (reference default, the `shared` structure): z-score each `(l, h)` row over the candidate
tokens (the unprotected ones; population std clamped at 1e-6), max over the `r` query heads of
each KV head's group, mean over layers -> `[B, G, n]`: one kept set per KV head shared by all
layers. The `per-layer` structure (`--routing per-layer`) skips the layer mean -> `[L, B, G, n]`, one kept set per (layer, KV head).

On an MLA latent cache (the view holds `c_kv` / `k_rope` stores, no per-head keys) the score is
derived in `docs/layouts.md` and computed by `retention.policy.scoring.latent`: per layer and query head
the RoPE term (this score on the shared RoPE key) plus the content term (the mean content query
absorbed into the latent), from the latent statistics of `retention.policy.scoring.calibration_latent`. The
aggregation is the same with one eviction head per layer whose group is all `H` query heads:
z-score each (layer, head) row over the candidates, max over the `H` heads, mean over layers
(`shared`, `[B, 1, n]`) or not (`per-layer`, `[L, B, 1, n]`).

Scoring runs in float32 (on a latent: float64 when the stores are float64); the phases
`w_f (t + d)` (up to ~1e5 rad) are formed in float64, where float32 would lose most of their
fractional part.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.runtime.cache import CacheView
from retention.policy.scoring.base import Scorer
from retention.policy.scoring.calibration import QueryStats, load_stats, rotary_inv_freq
from retention.policy.scoring.calibration_latent import latent_model, load_latent_stats
from retention.policy.scoring.frequency import OFFSETS, STD_FLOOR, future_phase, zscore_group_max, zscore_rows
from retention.policy.scoring.latent import LatentScoring, holds_latent

__all__ = ["OFFSETS", "STD_FLOOR", "STRUCTURES", "TriAttention", "future_phase", "global_union_keep", "head_scores",
           "query_weights", "rope_inverted_head_scores", "zscore_group_max", "zscore_rows"]

STRUCTURES = ("shared", "per-layer")  # the kept-set structures it scores in, the default first


def query_weights(qm: torch.Tensor, qa: torch.Tensor, inv_freq: torch.Tensor, t: int, kv_heads: int,
                  freq_scale: torch.Tensor | None = None, offsets=OFFSETS, dtype: torch.dtype = torch.float32):
    """Per-query-head weights of the linear score form, for all layers at query position `t`.

    qm: `[L, Hq, F]` complex; qa: `[L, Hq, F]`; inv_freq: `[F]`; freq_scale: optional `[F]` weight of
    both terms per band (the reference's `freq_scale_sq`, ones for default RoPE; None = ones).
    Returns (trig `[L, G, r, d]`, norm `[L, G, r, F]`) in `dtype` (the scorer's float32; float64 for
    the exactness tests of `retention.policy.scoring.latent`): `s = k . trig + |k_f| . norm`.
    """
    L, Hq, F = qm.shape
    scale = 1.0 if freq_scale is None else freq_scale.double().to(qm.device)
    w = qm.to(torch.complex128) * future_phase(inv_freq, t, offsets).to(qm.device) * scale  # [L, Hq, F]
    trig = torch.cat([w.real, w.imag], dim=-1).to(dtype).reshape(L, kv_heads, Hq // kv_heads, 2 * F)
    norm = ((qa.double() - qm.to(torch.complex128).abs()) * scale).to(dtype).reshape(L, kv_heads, Hq // kv_heads, F)
    return trig, norm


def head_scores(keys: torch.Tensor, trig: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """Raw scores `s(l, h, j)` of one layer: keys `[B, G, n, d]` (post-RoPE), trig `[G, r, d]`,
    norm `[G, r, F]` -> `[B, G, r, n]` in the weights' dtype (float32 from the scorer)."""
    k = keys.to(trig.dtype)
    F = k.shape[-1] // 2
    kmod = torch.hypot(k[..., :F], k[..., F:])  # [B, G, n, F]: |k_f|, unchanged by RoPE
    return torch.einsum("bgnd,grd->bgrn", k, trig) + torch.einsum("bgnf,grf->bgrn", kmod, norm)


def rope_inverted_head_scores(keys: torch.Tensor, positions: torch.Tensor, qm: torch.Tensor, qa: torch.Tensor,
                              inv_freq: torch.Tensor, t: int, offsets=OFFSETS) -> torch.Tensor:
    """The same raw scores computed the long way, in float64: un-rotate the stored keys to pre-RoPE,
    `k_pre_f = k_f exp(-i w_f p_j)`, then
    `trig = mean_d sum_f Re(Qm_f conj(k_pre_f) exp(i w_f (t + d - p_j)))`, `norm` with `|k_pre_f|`.

    keys `[B, G, n, d]`, positions `[B, G, n]`, qm/qa `[Hq, F]` (one layer) -> `[B, G, r, n]` float64.
    """
    k = keys.double()
    F = k.shape[-1] // 2
    G, Hq = k.shape[1], qm.shape[0]
    w = inv_freq.double()
    kc = torch.complex(k[..., :F], k[..., F:])  # [B, G, n, F]
    p = positions.double()[..., None]  # [B, G, n, 1]
    k_pre = kc * torch.polar(torch.ones_like(p * w), -(p * w))
    d = torch.tensor(offsets, dtype=torch.float64)
    rel = (float(t) + d - p[..., None]) * w[:, None]  # [B, G, n, F, |D|]: phase of query t+d vs key p_j
    phase = torch.polar(torch.ones_like(rel), rel).mean(-1)  # [B, G, n, F]
    qmg = qm.to(torch.complex128).reshape(G, Hq // G, F)
    trig = torch.einsum("grf,bgnf->bgrn", qmg, k_pre.conj() * phase).real
    norm = torch.einsum("grf,bgnf->bgrn", qa.double().reshape(G, Hq // G, F) - qmg.abs(), k_pre.abs())
    return trig + norm


def global_union_keep(z: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The reference's `per_head_pruning=False` selection: one kept set shared by every head.

    z: `[B, R, n]` standardised score rows (all `R = L * Hq` (layer, query head) rows); valid:
    `[B, n]` bool (False on padding). Each row nominates its top `k`; among the union of the
    nominees the `k` with the highest max-over-rows score are kept (the union of `R >= 1` rows of
    `k` distinct picks always holds at least `k`). Returns `[B, k]` ascending.
    """
    z = z.float().masked_fill(~valid[:, None, :], float("-inf"))
    nominated = torch.zeros_like(valid)
    nominated.scatter_(-1, torch.topk(z, k, dim=-1).indices.flatten(1), True)
    combined = z.amax(dim=1).masked_fill(~nominated, float("-inf"))
    return torch.sort(torch.topk(combined, k, dim=-1).indices, dim=-1).values


@dataclass
class TriAttention(Scorer):
    """Query-free top-k per KV head. Parameter: `stats` (statistics file; default: the model's
    default location). Scores in either kept-set structure, `shared` by default (the routing family
    chooses: `--routing per-layer`). Protects nothing by default."""

    name: ClassVar[str] = "triattention"
    batch_prefill: ClassVar[bool] = True  # reads no query or attention of the forward

    # Per-head post-RoPE keys, or an MLA latent (with the model's up-projections), and the statistics.
    reads: ClassVar[tuple[frozenset[str], ...]] = (frozenset({"keys", "calibration"}),
                                                  frozenset({"latent", "calibration"}))
    structures: ClassVar[tuple[str, ...]] = STRUCTURES

    stats: str | None = None
    # The kept-set structure the routing family set (`Scorer.structured`): not a parameter.
    _structure: str = field(default="shared", init=False, repr=False)
    _stats: QueryStats | None = field(default=None, init=False, repr=False)
    _inv_freq: torch.Tensor | None = field(default=None, init=False, repr=False)
    _latent: LatentScoring | None = field(default=None, init=False, repr=False)

    @property
    def per_layer(self) -> bool:  # an instance property: the routing family decides the score shape
        return self._structure == "per-layer"

    def bind(self, stats: QueryStats, inv_freq: torch.Tensor) -> None:
        """Use these statistics and rotary frequencies `[F]` (what `attach` does with the model's)."""
        self._stats, self._inv_freq = stats, inv_freq.float()

    def bind_latent(self, stats, latent) -> None:
        """Use these latent statistics (`retention.policy.scoring.calibration_latent.LatentStats`) and this MLA model
        (`LatentModel`) for views that hold a latent (what `attach` does with an MLA model)."""
        self._latent = LatentScoring(stats, latent)

    @contextlib.contextmanager
    def _attached(self, model):
        if self._stats is None and self._latent is None:  # loaded once per scorer (benchmarks attach per step)
            latent = latent_model(model)
            if latent is not None:
                self.bind_latent(load_latent_stats(self.stats, model, latent), latent)
            else:
                self.bind(load_stats(self.stats, model), rotary_inv_freq(model))
        yield self

    def attach(self, model):
        return self._attached(model)

    def layer_scores(self, view: CacheView):
        """Yield, per layer (eviction group), `[B, G, n]` group-max z-scores (see module doc)."""
        if not view.keys:
            yield from self._latent_layer_scores(view)
            return
        if self._stats is None:
            raise RuntimeError("triattention scorer used outside attach() (no per-head statistics bound)")
        G = view.keys[0].shape[1]
        dev = view.keys[0].device
        t = view.uniform_next_position
        if t is not None:  # every row queries at the same position: one set of weights
            trig, norm = query_weights(self._stats.qm, self._stats.qa, self._inv_freq, t, G)
            trig, norm = trig.to(dev), norm.to(dev)
        else:  # rows of a batch at different positions: weights per row, `[L, B, G, r, *]`
            ws = {t: query_weights(self._stats.qm, self._stats.qa, self._inv_freq, t, G)
                  for t in set(view.next_position.tolist())}
            rows = [ws[t] for t in view.next_position.tolist()]
            trig = torch.stack([w[0] for w in rows], dim=1).to(dev)
            norm = torch.stack([w[1] for w in rows], dim=1).to(dev)
        for l in range(view.num_layers):
            if t is not None:
                raw = head_scores(view.keys[l], trig[l], norm[l])
            else:
                k = view.keys[l].float()
                kmod = torch.hypot(k[..., :k.shape[-1] // 2], k[..., k.shape[-1] // 2:])
                raw = torch.einsum("bgnd,bgrd->bgrn", k, trig[l]) + torch.einsum("bgnf,bgrf->bgrn", kmod, norm[l])
            valid = view.valid[l]
            yield zscore_group_max(raw, ~view.protected[l] & valid).masked_fill(~valid, float("-inf"))

    def _latent_layer_scores(self, view: CacheView):
        """Per eviction group of a latent view, `[B, 1, n]`: each head's row z-scored over the
        candidates, max over all `H` query heads (one eviction head per MLA layer)."""
        if not holds_latent(view):
            raise RuntimeError(f"{self.name}: the view holds neither per-head keys nor an MLA latent "
                               f"(stores {sorted(view.stores[0]) if view.stores else []})")
        if self._latent is None:
            raise RuntimeError(f"{self.name} scorer used outside attach() on a latent cache (no latent statistics)")
        for g in range(view.num_layers):
            raw = self._latent.raw(view, g)[:, None]  # [B, 1, H, n]: the H heads are one group
            valid = view.valid[g]
            yield zscore_group_max(raw, ~view.protected[g] & valid).masked_fill(~valid, float("-inf"))

    def score(self, view: CacheView) -> torch.Tensor:
        """`[B, G, n]` (shared routing: mean over layers) or `[L, B, G, n]` (per-layer routing)."""
        if self.per_layer:
            return torch.stack(list(self.layer_scores(view)))
        total = None
        for s in self.layer_scores(view):
            total = s if total is None else total + s
        return total / view.num_layers
