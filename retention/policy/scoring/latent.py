"""TriAttention scores and alpha's V-signatures on an MLA latent cache, without per-head keys or values.

The derivation is in `docs/layouts.md` ("TriAttention and alpha on latent caches"). In short, for
query head `h` and cached token `j` the MLA logit is

    logit(h, j) = scale * ( q_nope_h . (W_UK_h c_j)  +  q_rope_h(t) . k_rope_j )

(`retention.models.arch.modules.MLAttention`; `scale = (d_nope + d_rope)^-1/2`, one positive factor for
both parts). The position lives only in the shared RoPE key, so TriAttention's score splits into

* a RoPE term: TriAttention's frequency score on the shared `k_rope` with the head's statistics of
  its (pre-RoPE) rope query, `sum_f Re(W_hf conj(k_jf)) + sum_f (Qa_hf - |Qm_hf|) |k_jf|`,
  `W_hf = Qm_hf * mean_o exp(i w_f (t + o))` (the linear form of `retention.policy.scoring.triattention`);
* a position-free content term: the mean content logit `m_h . c_j` with the absorbed mean query
  `m_h = W_UK_h^T E[q_nope_h]` (TriAttention's trigonometric term at frequency 0, exact on the
  latent), plus, optionally, TriAttention's norm term at frequency 0,
  `sum_e (E|q_nope_he| - |E q_nope_he|) |(W_UK_h c_j)_e|`, which needs each head's content key
  (`|.|` does not pass through the up-projection): it is computed by materialising them.

The common factor `scale` is left out (it changes neither rankings nor the per-head z-scores).

alpha's V-signature of a token is the mean of its values over layers and heads, L2-normalised
(`retention.policy.scoring.alpha.token_signatures`). On a latent cache head `h`'s value is `W_UV_h c_j`, and
the mean over heads passes through the linear map: `mean_h W_UV_h c_j = (mean_h W_UV_h) c_j`, so the
signature is exact from the latent at `r x d_v` multiply-adds per token and layer.

`LatentScoring` applies both to the latent stores of a `CacheView`; `triattention` and `alpha`
dispatch to it when the view holds a latent (statistics: `retention.policy.scoring.calibration_latent`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from retention.policy.scoring.frequency import OFFSETS, future_phase


def rope_bands(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Real and imaginary parts `[..., F]` of the RoPE bands of `x` `[..., 2F]`: pairs `(2f, 2f+1)`
    (`retention.models.arch.modules.rope`, DeepSeek's complex form) or `(f, f+F)` (Llama's half split)."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def latent_triattention_scores(latent: torch.Tensor, k_rope: torch.Tensor, next_position: int | torch.Tensor,
                               rope_qm: torch.Tensor, rope_qa: torch.Tensor, inv_freq: torch.Tensor,
                               content_mean: torch.Tensor, w_uk_t: torch.Tensor, *,
                               content_qa: torch.Tensor | None = None, content_factor: torch.Tensor | None = None,
                               offsets=OFFSETS, interleaved: bool = True, rope_scale: float = 1.0) -> torch.Tensor:
    """Raw TriAttention scores of every query head on every cached token of one MLA layer.

    latent `[B, n, r]`: the cached (normalised) latents `c_j`.
    k_rope `[B, n, d_r]`: the cached RoPE keys, post-RoPE (rotated at their own positions).
    next_position: the next query's absolute position `t` (an int, or `[B]` per row).
    rope_qm `[H, d_r/2]` complex, rope_qa `[H, d_r/2]`: per head, the mean and the mean modulus of the
        pre-RoPE rope query per band (bands as `interleaved` says).
    inv_freq `[d_r/2]`: the RoPE frequencies `w_f` of those bands.
    content_mean `[H, d_nope]`: per head, the mean content query `E[q_nope_h]`.
    w_uk_t `[H, r, d_nope]`: per head, the transposed key up-projection `W_UK_h^T`
        (`MLAttention.up_weights()[0].transpose(1, 2)`; for QK-norm MLA with the key norm's weight
        folded in, `W_UK_g^T diag(gamma)` repeated over the group's heads).
    content_qa `[H, d_nope]`, optional: per head, the mean modulus `E|q_nope_he|` per content dim; given,
        the content norm term is added (materialises the per-head content keys `[B, H, n, d_nope]`).
    content_factor `[B, Gc, n]`, optional: a positive per-token factor of the content key of each group
        of `H / Gc` heads (QK-norm MLA's cached inverse RMS); None: 1.
    offsets: TriAttention's future offsets `o` (default `{1, 2, 4, ..., 2^16}`).
    interleaved: the band pairing of the stored key (`rope_bands`).
    rope_scale: a factor the model's rotation applies to both the rope query and key (YaRN's attention
        factor in DeepSeek checkpoints): the stored key carries it, the pre-RoPE statistics do not,
        so the RoPE term is multiplied by it once.

    Returns `[B, H, n]` in the dtype of `latent` (phases formed in float64).
    """
    B, n, _ = latent.shape
    H = w_uk_t.shape[0]
    dtype = latent.dtype
    # Content: the absorbed mean query against the latent, m_h = W_UK_h^T E[q_nope_h]  [H, r].
    m = torch.einsum("hre,he->hr", w_uk_t.to(dtype), content_mean.to(dtype))
    content = torch.einsum("bnr,hr->bhn", latent, m)
    if content_qa is not None:
        k_nope = torch.einsum("bnr,hre->bhne", latent, w_uk_t.to(dtype))  # the only materialisation
        spread = (content_qa.to(dtype) - content_mean.to(dtype).abs())  # [H, d_nope], >= 0 for real statistics
        content = content + torch.einsum("bhne,he->bhn", k_nope.abs(), spread)
    if content_factor is not None:
        per_head = content_factor.to(dtype).repeat_interleave(H // content_factor.shape[1], dim=1)
        content = content * per_head
    # RoPE term: TriAttention's linear form on the shared key, W_hf = Qm_hf * mean_o exp(i w_f (t + o)).
    re, im = rope_bands(k_rope.to(dtype), interleaved)  # [B, n, F]
    qm = rope_qm.to(torch.complex128)
    if isinstance(next_position, int):
        w = (qm * future_phase(inv_freq, next_position, offsets).to(qm.device))[None].expand(B, -1, -1)
    else:
        phases = torch.stack([future_phase(inv_freq, int(t), offsets) for t in next_position.tolist()])  # [B, F]
        w = qm[None] * phases[:, None].to(qm.device)
    trig = torch.einsum("bnf,bhf->bhn", re, w.real.to(dtype)) + torch.einsum("bnf,bhf->bhn", im, w.imag.to(dtype))
    norm = torch.einsum("bnf,hf->bhn", torch.hypot(re, im), (rope_qa.to(torch.float64) - qm.abs()).to(dtype))
    rope = trig + norm
    return content + (rope if rope_scale == 1.0 else rope * rope_scale)


def latent_value_signatures(latents: Sequence[torch.Tensor], w_uv: Sequence[torch.Tensor]) -> torch.Tensor:
    """alpha's V-signatures of tokens from their latents: `normalize(mean_l mean_h W_UV_lh c_lj)`.

    latents: `L` tensors `[B, n, r]` (each layer's cached latent of the same `n` tokens);
    w_uv: `L` tensors `[H, d_v, r]` (each layer's value up-projection, `MLAttention.up_weights()[1]`).
    Returns `[B, n, d_v]` unit rows in the latents' dtype (a zero mean stays zero, as in
    `retention.policy.scoring.alpha.token_signatures`). The mean over heads is taken on the weights
    (`[d_v, r]` per layer), so no per-head value is formed.
    """
    total = None
    for c, w in zip(latents, w_uv, strict=True):
        part = torch.einsum("bnr,vr->bnv", c, w.to(c.dtype).mean(0))
        total = part if total is None else total + part
    return F.normalize(total / len(latents), dim=-1)


def _store(stores: dict[str, torch.Tensor], suffix: str) -> torch.Tensor | None:
    """The store of a group whose name ends with `.suffix` (`L{layer}.c_kv`, ...), None if absent."""
    found = [t for name, t in stores.items() if name.endswith("." + suffix)]
    return found[0] if len(found) == 1 else None


def holds_latent(view) -> bool:
    """Whether a `CacheView` holds an MLA latent (`c_kv` and `k_rope` stores per eviction group)."""
    return not view.keys and bool(view.stores) and all(
        _store(s, "c_kv") is not None and _store(s, "k_rope") is not None for s in view.stores)


class LatentScoring:
    """TriAttention's raw scores on the latent stores of a `CacheView`, and alpha's V-signatures
    written into the cache, for one MLA model (`retention.policy.scoring.calibration_latent.LatentModel`) and its
    latent statistics.

    The view (issue 20's one cache): eviction group `g` is MLA layer `groups[g][0]`, with stores
    `L{l}.c_kv` `[B, 1, n, r]`, `L{l}.k_rope` `[B, 1, n, d_r]` and, for QK-norm MLA, `L{l}.inv_rms`
    `[B, G, n, 1]`. Scores are computed in float32, or float64 when the stores are float64.
    """

    def __init__(self, stats, latent):
        self.stats, self.latent = stats, latent
        weights = [latent.up_weights(layer) for layer in range(len(latent.attention))]
        self.w_uk_t = [w[0].float() if w[0].dtype != torch.float64 else w[0] for w in weights]  # [H, r, d_nope]
        self.w_uv = [w[1].float() if w[1].dtype != torch.float64 else w[1] for w in weights]  # [H, d_v, r]

    def _layer(self, view, g: int) -> int:
        members = view.groups[g]
        if len(members) != 1:
            raise RuntimeError(f"a latent eviction group of layers {members}: only one MLA layer per group is derived")
        return members[0]

    def raw(self, view, g: int) -> torch.Tensor:
        """`[B, H, n]`: every query head's TriAttention score of every token of group `g`."""
        layer, stores, st = self._layer(view, g), view.stores[g], self.stats
        c, kr, rho = _store(stores, "c_kv")[:, 0], _store(stores, "k_rope")[:, 0], _store(stores, "inv_rms")
        dtype = torch.float64 if c.dtype == torch.float64 else torch.float32
        dev = c.device
        t = view.uniform_next_position
        return latent_triattention_scores(
            c.to(dtype), kr.to(dtype), view.next_position if t is None else t, st.rope_qm[layer].to(dev),
            st.rope_qa[layer].to(dev), self.latent.inv_freq.to(dev), st.content_mean[layer].to(dev),
            self.w_uk_t[layer].to(dev), content_factor=None if rho is None else rho[..., 0],
            interleaved=self.latent.key_interleaved, rope_scale=self.latent.rope_scale)

    def write_signatures(self, cache, name: str, every_group: bool) -> None:
        """Write the V-signature `[d_v]` of every token the last forward wrote (every layer holds
        its latent now) as per-token state `name` of group 0 (or of every group, `every_group`),
        at that token's slot: `cache` is the one runtime's layout cache (`RetentionCache`:
        `written_slots`, `read`, `add_extra`). The state then follows every compaction, row move and
        refill, so a signature never depends on later evictions (as per-head `alpha`'s)."""
        idx = cache.written_slots()  # [S, q]
        S, q = idx.shape
        latents, w_uv = [], []
        for members in cache.groups:
            layer = members[0]
            stored = cache.read(f"L{layer}.c_kv")  # [S, 1, w, r]
            c = stored.gather(2, idx[:, None, :, None].expand(S, 1, q, stored.shape[-1]))[:, 0]  # [S, q, r]
            latents.append(c.to(torch.float64 if c.dtype == torch.float64 else torch.float32))
            w_uv.append(self.w_uv[layer].to(c.device))
        u = latent_value_signatures(latents, w_uv)  # [S, q, d_v]
        gidx = idx[:, None, :, None].expand(S, 1, q, u.shape[-1])
        for g in range(len(cache.groups)) if every_group else (0,):
            cache.add_extra(g, name, (u.shape[-1],), dtype=u.dtype).scatter_(2, gidx, u[:, None])
