"""TriAttention scores and alpha's V-signatures computed on an MLA latent (`retention.policy.scoring.latent`)
against the same computations on materialised per-head keys `k_h = [W_UK_h c_j ; k_rope_j]` and
values `v_h = W_UV_h c_j`, in float64.

The reference is TriAttention's score written the long way (golden README, section 1): un-rotate
the key to pre-RoPE, then `mean_o sum_f |q_f||k_f| cos((t - p + o) w_f + arg(q_f conj(k_f)))
+ sum_f (A_f - |q_f|) |k_f|`, over every band of the materialised key: the RoPE bands with their
frequencies, the content dims as one-dimensional bands of frequency 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from retention.models.arch.model import build_arch
from retention.models.arch.modules import _heads, rope
from retention.policy.scoring.alpha import token_signatures
from retention.policy.scoring.latent import latent_triattention_scores, latent_value_signatures
from retention.policy.scoring.triattention import OFFSETS

TOL = 1e-9
THETA = 10_000.0


def _inv_freq(d_r: int) -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, d_r, 2, dtype=torch.float64) / d_r)


def _rotate(x: torch.Tensor, pos: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x `[B, n, d]` rotated at positions `[B, n]` in either band convention."""
    if interleaved:
        return rope(x[:, None], pos, THETA)[:, 0]
    half = x.shape[-1] // 2
    ang = pos[..., None].double() * _inv_freq(x.shape[-1])
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(ang), ang)
    return torch.cat([z.real, z.imag], -1)


def _complex_bands(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.complex(x[..., 0::2], x[..., 1::2]) if interleaved else torch.complex(x[..., :half], x[..., half:])


def materialised_scores(keys, positions, t, q_mean, q_abs, omega, offsets=OFFSETS) -> torch.Tensor:
    """The README formula on materialised keys.

    keys `[B, H, n, K]` complex128, PRE-RoPE bands (content dims as real 1-D bands, RoPE bands
    un-rotated by the caller); positions `[B, n]`; t `[B]`; q_mean `[H, K]` complex; q_abs `[H, K]`;
    omega `[K]` (0 for the content dims). Returns `[B, H, n]`.
    """
    o = torch.tensor(offsets, dtype=torch.float64)
    rel = (t[:, None, None, None, None].double() - positions[:, None, :, None, None].double() + o) * omega[:, None]
    phase = torch.angle(q_mean[None, :, None, :] * keys.conj())  # [B, H, n, K]
    amp = q_mean.abs()[None, :, None, :] * keys.abs()
    trig = (amp[..., None] * torch.cos(rel + phase[..., None])).sum(-2).mean(-1)
    norm = ((q_abs - q_mean.abs())[None, :, None, :] * keys.abs()).sum(-1)
    return trig + norm


def _case(seed: int, interleaved: bool, with_spread: bool, with_factor: bool):
    g = torch.Generator().manual_seed(seed)
    B, n, r, H, Gc, d_nope, d_r = 2, 11, 10, 4, 2, 6, 8
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    latent, k_pre, w_uk_t = rnd(B, n, r), rnd(B, n, d_r), rnd(H, r, d_nope)
    positions = torch.stack([torch.randperm(300, generator=g)[:n].sort().values for _ in range(B)])
    t = positions.max(-1).values + 1 + torch.tensor([0, 7])
    k_rope = _rotate(k_pre, positions, interleaved)
    rope_qm = torch.complex(rnd(H, d_r // 2), rnd(H, d_r // 2))
    rope_qa = rope_qm.abs() + rnd(H, d_r // 2).abs()
    content_mean = rnd(H, d_nope)
    content_qa = content_mean.abs() + rnd(H, d_nope).abs() if with_spread else None
    factor = rnd(B, Gc, n).abs() + 0.1 if with_factor else None
    got = latent_triattention_scores(latent, k_rope, t, rope_qm, rope_qa, _inv_freq(d_r), content_mean, w_uk_t,
                                     content_qa=content_qa, content_factor=factor, interleaved=interleaved)
    # Materialise every head's key: k_h = [W_UK_h c_j (times the group's factor) ; k_rope_j].
    k_nope = torch.einsum("bnr,hre->bhne", latent, w_uk_t)
    if factor is not None:
        k_nope = k_nope * factor.repeat_interleave(H // Gc, dim=1)[..., None]
    rope_bands = _complex_bands(k_rope, interleaved)  # post-RoPE [B, n, F]
    ang = positions[..., None].double() * _inv_freq(d_r)
    rope_pre = rope_bands * torch.polar(torch.ones_like(ang), -ang)  # un-rotated: the long way
    keys = torch.cat([torch.complex(k_nope, torch.zeros_like(k_nope)), rope_pre[:, None].expand(-1, H, -1, -1)], -1)
    q_mean = torch.cat([torch.complex(content_mean, torch.zeros_like(content_mean)), rope_qm], -1)
    q_abs = torch.cat([content_qa if content_qa is not None else content_mean.abs(), rope_qa], -1)
    omega = torch.cat([torch.zeros(d_nope, dtype=torch.float64), _inv_freq(d_r)])
    want = materialised_scores(keys, positions, t, q_mean, q_abs, omega)
    return got, want


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("with_spread,with_factor", [(False, False), (True, False), (True, True)])
def test_latent_scores_equal_materialised(interleaved, with_spread, with_factor):
    got, want = _case(3, interleaved, with_spread, with_factor)
    assert got.shape == want.shape == (2, 4, 11) and got.dtype == torch.float64
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err < TOL, err
    # Not vacuous: another case's scores differ by far more than the tolerance.
    other, _ = _case(4, interleaved, with_spread, with_factor)
    assert (other - want).abs().max() > 1e-3


def test_scalar_and_per_row_positions_agree():
    g = torch.Generator().manual_seed(0)
    latent, k_rope = torch.randn(2, 5, 6, generator=g, dtype=torch.float64), torch.randn(2, 5, 4, generator=g,
                                                                                          dtype=torch.float64)
    args = (torch.randn(3, 2, dtype=torch.complex128, generator=g), torch.rand(3, 2, generator=g, dtype=torch.float64),
            _inv_freq(4), torch.randn(3, 5, generator=g, dtype=torch.float64),
            torch.randn(3, 6, 5, generator=g, dtype=torch.float64))
    a = latent_triattention_scores(latent, k_rope, 40, *args)
    b = latent_triattention_scores(latent, k_rope, torch.tensor([40, 40]), *args)
    assert torch.equal(a, b)


@pytest.fixture(scope="module")
def tiny_mla():
    """tiny-mla in float64 after a 20-token prefill: (model, cache, hidden input of layer 0 `[1, q, hidden]`)."""
    model = build_arch("tiny-mla", dtype=torch.float64)
    ids = torch.randint(0, 259, (1, 20), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(20)[None]
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, pos, cache)
        x0 = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    return model, cache, x0


def test_single_query_statistics_give_the_mla_logit(tiny_mla):
    """With the statistics of one query (its own mean, no spread) and the offset 0, the score is
    that query's attention logit over the softmax scale, on the module's own cache and weights: the
    conventions (interleaved RoPE bands, the kv_b_proj split, the absorbed content term) are MLA's."""
    model, cache, x0 = tiny_mla
    attn, c = model.model.layers[0].self_attn, model.config
    latent, k_rope = cache.read("L0.c_kv")[:, 0], cache.read("L0.k_rope")[:, 0]  # [1, n, r], [1, n, d_r]
    t = 19
    with torch.no_grad():
        q = _heads(attn.q_proj(x0[:, t:t + 1]), c.q_heads)[:, :, 0]  # [1, H, nope + rope], pre-RoPE
        q_nope, q_rope_pre = q.split([c.nope_dim, c.rope_dim], -1)
        w_uk, _ = attn.up_weights()
        # The module's materialised logits (its absorb=False path) for the query at position t.
        k = torch.cat([torch.einsum("bnc,hec->bhne", latent, w_uk), k_rope[:, None].expand(-1, c.q_heads, -1, -1)], -1)
        q_full = torch.cat([q_nope, rope(q_rope_pre[:, :, None], torch.tensor([[t]]), c.rope_theta)[:, :, 0]], -1)
        logits = torch.einsum("bhd,bhnd->bhn", q_full, k) * attn.scaling
    qm = torch.complex(q_rope_pre[0, :, 0::2], q_rope_pre[0, :, 1::2])
    got = latent_triattention_scores(latent, k_rope, t, qm, qm.abs(), _inv_freq(c.rope_dim), q_nope[0],
                                     w_uk.transpose(1, 2), content_qa=q_nope[0].abs(), offsets=(0,))
    err = (got * attn.scaling - logits).abs().max().item() / logits.abs().max().item()
    assert err < TOL, err


def test_latent_value_signatures_equal_materialised(tiny_mla):
    model, cache, _ = tiny_mla
    layers = model.model.layers
    latents = [cache.read(f"L{i}.c_kv")[:, 0] for i in range(len(layers))]
    w_uv = [layer.self_attn.up_weights()[1] for layer in layers]
    with torch.no_grad():
        got = latent_value_signatures(latents, w_uv)
        values = [torch.einsum("bnc,hvc->bhnv", c, w) for c, w in zip(latents, w_uv)]  # [B, H, n, d_v] per layer
    want = torch.nn.functional.normalize(torch.stack(values).mean(dim=(0, 2)), dim=-1)
    assert got.shape == want.shape == (1, 20, model.config.v_dim) and got.dtype == torch.float64
    err = (got - want).abs().max().item()
    assert err < TOL, err
    # alpha's own function on the materialised values (it computes in float32).
    assert (got - token_signatures(values).double()).abs().max().item() < 1e-6
    # Not vacuous: the signature of another layer set differs.
    assert (latent_value_signatures(latents[:2], w_uv[:2]) - want).abs().max() > 1e-3
    assert math.isclose(got.norm(dim=-1).min().item(), 1.0, rel_tol=1e-12)
