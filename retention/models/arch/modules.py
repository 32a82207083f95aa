"""RMSNorm, RoPE and the attention of each layout family, reading and writing the layout cache
(`retention.runtime.cache.RetentionCache.for_layout`: `append`/`read` a store, `layer_positions`, `note_attention`).

Shapes: batch `B`, query heads `H`, eviction heads `G` (KV heads; 1 for a latent), new tokens `q`,
stored tokens `n`. Every module takes `x` `[B, q, hidden]`, absolute positions `pos` `[B, q]`, the
cache and its layer index, and returns `[B, q, hidden]`. Parameter names follow transformers'
Llama/DeepSeek-V2 modules so weights load across (`ArchLM.load_state_dict`).

RoPE rotates consecutive pairs `(x[2i], x[2i+1])` (DeepSeek-V2's complex form) with frequency
`theta^(-2i/d)`. The causal mask compares stored positions with query positions, so it stays right
after any eviction.
"""

from __future__ import annotations

import torch
from torch import nn

from retention.runtime.cache import RetentionCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        """`1 / rms(x)` over the last dim, keepdim: the one scalar a QK-norm MLA caches."""
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * self.inv_rms(x))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, offset: int = 0, total: int | None = None) -> torch.Tensor:
    """Rotate `x` `[B, h, q, d]` at positions `pos` (`[B, q]` or `[B, h, q]`).

    `x` may be the slice `[offset, offset + d)` of a `total`-wide head (a concat path's delta):
    it then gets that slice's frequencies, so rotating the parts equals rotating the whole.
    """
    d = x.shape[-1]
    total = total or d
    # Angles in float32 (as transformers computes them) unless the model runs in float64.
    precision = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(offset, offset + d, 2, device=x.device).to(precision) / total))
    if pos.dim() == 2:
        pos = pos[:, None]
    angle = pos[..., None].to(precision) * inv_freq  # [B, 1|h, q, d/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """`[B, G, 1, q, n]`: stored key positions `[B, G, n]` at or before query positions `[B, q]`."""
    return k_pos[:, :, None, None, :] <= q_pos[:, None, None, :, None]


def attend(q, k, v, q_pos, k_pos, scale: float, cache: RetentionCache, layer: int) -> torch.Tensor:
    """Grouped attention: q `[B, H, q, dk]`, k `[B, G, n, dk]`, v `[B, G, n, dv]` -> `[B, H, q, dv]`."""
    b, h, nq, _ = q.shape
    g = k.shape[1]
    scores = torch.einsum("bgrqd,bgnd->bgrqn", q.view(b, g, h // g, nq, -1), k) * scale
    probs = softmax_masked(scores, causal_mask(q_pos, k_pos))
    cache.note_attention(layer, probs)
    return torch.einsum("bgrqn,bgnd->bgrqd", probs, v).reshape(b, h, nq, -1)


def softmax_masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of scores where `mask` holds, 0 elsewhere."""
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[B, q, heads * d]` -> `[B, heads, q, d]`."""
    b, q, _ = x.shape
    return x.view(b, q, heads, -1).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, q, d]` -> `[B, q, H * d]`."""
    b, h, q, d = x.shape
    return x.transpose(1, 2).reshape(b, q, h * d)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class KVAttention(nn.Module):
    """MHA/GQA/MQA, and CLA: the first layer of each group of `share` layers writes K/V."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.writes = layer % cfg.share == 0
        self.store = f"L{layer}" if cfg.family == "kv" else f"G{layer // cfg.share}"
        self.q_proj = _linear(cfg.hidden, cfg.q_heads * cfg.head_dim)
        if self.writes:
            self.k_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.head_dim)
            self.v_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.head_dim)
        self.o_proj = _linear(cfg.q_heads * cfg.head_dim, cfg.hidden)

    def forward(self, x, pos, cache: RetentionCache):
        c = self.cfg
        q = rope(_heads(self.q_proj(x), c.q_heads), pos, c.rope_theta)
        if self.writes:
            cache.append(f"{self.store}.k", rope(_heads(self.k_proj(x), c.kv_heads), pos, c.rope_theta))
            cache.append(f"{self.store}.v", _heads(self.v_proj(x), c.kv_heads))
        k, v = cache.read(f"{self.store}.k"), cache.read(f"{self.store}.v")
        out = attend(q, k, v, pos, cache.layer_positions(self.layer), c.head_dim**-0.5, cache, self.layer)
        return self.o_proj(_merge(out))


class PathConcatAttention(nn.Module):
    """Cross-layer path, concat: per head K = [alpha_k ; delta_k], V = [alpha_v ; delta_v], where
    the path's first layer writes alpha (from its own input) and every layer writes its delta."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.path = layer // cfg.share
        self.writes_alpha = layer % cfg.share == 0
        width = cfg.shared_dim + cfg.layer_dim
        self.q_proj = _linear(cfg.hidden, cfg.q_heads * width)
        if self.writes_alpha:
            self.alpha_k_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.shared_dim)
            self.alpha_v_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.shared_dim)
        self.delta_k_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.layer_dim)
        self.delta_v_proj = _linear(cfg.hidden, cfg.kv_heads * cfg.layer_dim)
        self.o_proj = _linear(cfg.q_heads * width, cfg.hidden)

    def forward(self, x, pos, cache: RetentionCache):
        c, g = self.cfg, self.cfg.kv_heads
        width = c.shared_dim + c.layer_dim
        alpha, delta = f"P{self.path}.alpha", f"L{self.layer}.delta"
        if self.writes_alpha:
            cache.append(f"{alpha}.k", rope(_heads(self.alpha_k_proj(x), g), pos, c.rope_theta, 0, width))
            cache.append(f"{alpha}.v", _heads(self.alpha_v_proj(x), g))
        dk = cache.append(f"{delta}.k", rope(_heads(self.delta_k_proj(x), g), pos, c.rope_theta, c.shared_dim, width))
        dv = cache.append(f"{delta}.v", _heads(self.delta_v_proj(x), g))
        k = torch.cat([cache.read(f"{alpha}.k"), dk], -1)
        v = torch.cat([cache.read(f"{alpha}.v"), dv], -1)
        q = rope(_heads(self.q_proj(x), c.q_heads), pos, c.rope_theta)
        out = attend(q, k, v, pos, cache.layer_positions(self.layer), width**-0.5, cache, self.layer)
        return self.o_proj(_merge(out))


class PathResidualAttention(nn.Module):
    """Cross-layer path, residual: the path's first layer writes full K/V; layer `j` of the path
    attends with `K_j = K_{j-1} + rope(E_j delta_j)` (and likewise V, unrotated), where `delta_j`
    is its stored `layer_dim` delta and `E_j` a per-head `layer_dim -> head_dim` expansion.

    The running `K_{j-1}` is rebuilt each forward from the stores (the cache holds only the
    compressed representation) and handed down the path through `cache.scratch`.
    """

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.path = layer // cfg.share
        self.first = layer % cfg.share == 0
        g, d, dd = cfg.kv_heads, cfg.head_dim, cfg.layer_dim
        self.q_proj = _linear(cfg.hidden, cfg.q_heads * d)
        if self.first:
            self.k_proj = _linear(cfg.hidden, g * d)
            self.v_proj = _linear(cfg.hidden, g * d)
        else:
            self.delta_k_proj = _linear(cfg.hidden, g * dd)
            self.delta_v_proj = _linear(cfg.hidden, g * dd)
            self.k_expand = nn.Parameter(torch.empty(g, dd, d))
            self.v_expand = nn.Parameter(torch.empty(g, dd, d))
        self.o_proj = _linear(cfg.q_heads * d, cfg.hidden)

    def forward(self, x, pos, cache: RetentionCache):
        c, g = self.cfg, self.cfg.kv_heads
        k_pos = cache.layer_positions(self.layer)
        if self.first:
            k = cache.append(f"P{self.path}.base.k", rope(_heads(self.k_proj(x), g), pos, c.rope_theta))
            v = cache.append(f"P{self.path}.base.v", _heads(self.v_proj(x), g))
        else:
            k_prev, v_prev = cache.scratch[self.path]
            dk = cache.append(f"L{self.layer}.delta.k", _heads(self.delta_k_proj(x), g))
            dv = cache.append(f"L{self.layer}.delta.v", _heads(self.delta_v_proj(x), g))
            # The delta is stored unrotated; its expansion is rotated at the stored positions.
            k = k_prev + rope(torch.einsum("bgne,ged->bgnd", dk, self.k_expand), k_pos, c.rope_theta)
            v = v_prev + torch.einsum("bgne,ged->bgnd", dv, self.v_expand)
        cache.scratch[self.path] = (k, v)
        q = rope(_heads(self.q_proj(x), c.q_heads), pos, c.rope_theta)
        out = attend(q, k, v, pos, k_pos, c.head_dim**-0.5, cache, self.layer)
        return self.o_proj(_merge(out))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3; queries compressed through a `q_lora_rank` latent
    when the config has one, as DeepSeek-V3 does).

    Cached per token: `c_kv` `[B, 1, n, latent]` (after `kv_a_layernorm`) and the decoupled RoPE
    key `[B, 1, n, rope]`. Per head `k = [W_uk c ; k_rope]`, `v = W_uv c` with `kv_b_proj` =
    `[W_uk ; W_uv]` per head. `absorb=True` never materialises them: scores `(W_uk^T q_nope) . c +
    q_rope . k_rope`, output `W_uv (sum_n p_n c_n)`; `absorb=False` materialises keys/values.
    """

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.absorb = True
        # A checkpoint's own softmax scale and rotation (YaRN) replace these (`retention.models.arch.deepseek`).
        self.scaling = (cfg.nope_dim + cfg.rope_dim) ** -0.5
        self.rotate = None  # (x [B, h, q, d], pos [B, q]) -> rotated x; None: `rope` with `cfg.rope_theta`
        h = cfg.q_heads
        if cfg.q_lora_rank:
            self.q_a_proj = _linear(cfg.hidden, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = _linear(cfg.q_lora_rank, h * (cfg.nope_dim + cfg.rope_dim))
        else:
            self.q_proj = _linear(cfg.hidden, h * (cfg.nope_dim + cfg.rope_dim))
        self.kv_a_proj_with_mqa = _linear(cfg.hidden, cfg.latent_dim + cfg.rope_dim)
        self.kv_a_layernorm = RMSNorm(cfg.latent_dim, cfg.norm_eps)
        self.kv_b_proj = _linear(cfg.latent_dim, h * (cfg.nope_dim + cfg.v_dim))
        self.o_proj = _linear(h * cfg.v_dim, cfg.hidden)

    def write_latent(self, x, pos, cache: RetentionCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's latent and RoPE key; return all stored: `[B, 1, n, latent]`, `[B, 1, n, rope]`."""
        c = self.cfg
        latent, k_rope = self.kv_a_proj_with_mqa(x)[:, None].split([c.latent_dim, c.rope_dim], -1)
        ckv = cache.append(f"L{self.layer}.c_kv", self.kv_a_layernorm(latent))
        kr = cache.append(f"L{self.layer}.k_rope", self._rope(k_rope, pos))
        return ckv, kr

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rope(x, pos, self.cfg.rope_theta) if self.rotate is None else self.rotate(x, pos)

    def query(self, x, pos) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = _heads(q, c.q_heads).split([c.nope_dim, c.rope_dim], -1)
        return q_nope, self._rope(q_rope, pos)

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`W_uk` `[H, nope, latent]`, `W_uv` `[H, v, latent]`."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.q_heads, c.nope_dim + c.v_dim, c.latent_dim)
        return w[:, : c.nope_dim], w[:, c.nope_dim :]

    def forward(self, x, pos, cache: RetentionCache):
        c = self.cfg
        ckv, kr = self.write_latent(x, pos, cache)
        q_nope, q_rope = self.query(x, pos)
        k_pos = cache.layer_positions(self.layer)
        scale = self.scaling
        w_uk, w_uv = self.up_weights()
        if self.absorb:
            q_latent = torch.einsum("bhqe,hec->bhqc", q_nope, w_uk)
            scores = torch.einsum("bhqc,bnc->bhqn", q_latent, ckv[:, 0]) + torch.einsum("bhqr,bnr->bhqn", q_rope, kr[:, 0])
            probs = softmax_masked(scores * scale, causal_mask(pos, k_pos)[:, 0])
            cache.note_attention(self.layer, probs[:, None])
            out = torch.einsum("bhqc,hvc->bhqv", torch.einsum("bhqn,bnc->bhqc", probs, ckv[:, 0]), w_uv)
        else:
            k_nope = torch.einsum("bnc,hec->bhne", ckv[:, 0], w_uk)
            v = torch.einsum("bnc,hvc->bhnv", ckv[:, 0], w_uv)
            k = torch.cat([k_nope, kr.expand(-1, c.q_heads, -1, -1)], -1)
            q = torch.cat([q_nope, q_rope], -1)
            out = attend(q, k, v, pos, k_pos.expand(-1, c.q_heads, -1), scale, cache, self.layer)
        return self.o_proj(_merge(out))


class QKNormMLAttention(MLAttention):
    """MLA with RMSNorm on queries and keys, content and RoPE parts normalised separately.

    Keys come per KV group (`kv_heads` groups, `W_uk` `[G, nope, latent]`). The content key's
    RMSNorm, `gamma * k / rms(k)`, folds into the latent path: `gamma` (static) into the query,
    `q' = W_uk^T (gamma * q_norm(q_nope))`, and `1 / rms(W_uk c)` (per token and group) is cached,
    so scores are `(q' . c) * inv_rms + q_rope . k_rope`. The RoPE key is normalised before it is
    rotated and stored. `absorb=False` materialises the normalised keys instead.
    """

    def __init__(self, cfg, layer: int):
        nn.Module.__init__(self)
        self.cfg, self.layer = cfg, layer
        self.absorb = True
        h, g = cfg.q_heads, cfg.kv_heads
        self.q_proj = _linear(cfg.hidden, h * (cfg.nope_dim + cfg.rope_dim))
        self.kv_a_proj_with_mqa = _linear(cfg.hidden, cfg.latent_dim + cfg.rope_dim)
        self.kv_a_layernorm = RMSNorm(cfg.latent_dim, cfg.norm_eps)
        self.k_b_proj = _linear(cfg.latent_dim, g * cfg.nope_dim)
        self.v_b_proj = _linear(cfg.latent_dim, h * cfg.v_dim)
        self.q_norm, self.q_rope_norm = RMSNorm(cfg.nope_dim, cfg.norm_eps), RMSNorm(cfg.rope_dim, cfg.norm_eps)
        self.k_norm, self.k_rope_norm = RMSNorm(cfg.nope_dim, cfg.norm_eps), RMSNorm(cfg.rope_dim, cfg.norm_eps)
        self.o_proj = _linear(h * cfg.v_dim, cfg.hidden)

    def forward(self, x, pos, cache: RetentionCache):
        c, h, g = self.cfg, self.cfg.q_heads, self.cfg.kv_heads
        latent, k_rope = self.kv_a_proj_with_mqa(x)[:, None].split([c.latent_dim, c.rope_dim], -1)
        latent = self.kv_a_layernorm(latent)
        w_uk = self.k_b_proj.weight.view(g, c.nope_dim, c.latent_dim)
        w_uv = self.v_b_proj.weight.view(h, c.v_dim, c.latent_dim)
        k_content = torch.einsum("bnc,gec->bgne", latent[:, 0], w_uk)
        ckv = cache.append(f"L{self.layer}.c_kv", latent)
        kr = cache.append(f"L{self.layer}.k_rope", rope(self.k_rope_norm(k_rope), pos, c.rope_theta))
        inv_rms = cache.append(f"L{self.layer}.inv_rms", self.k_norm.inv_rms(k_content))  # [B, G, n, 1]
        q_nope, q_rope = _heads(self.q_proj(x), h).split([c.nope_dim, c.rope_dim], -1)
        q_nope = self.q_norm(q_nope).view(q_nope.shape[0], g, h // g, *q_nope.shape[2:])  # [B, G, r, q, nope]
        q_rope = rope(self.q_rope_norm(q_rope), pos, c.rope_theta).view(q_nope.shape[:-1] + (c.rope_dim,))
        scale = (c.nope_dim + c.rope_dim) ** -0.5
        k_pos = cache.layer_positions(self.layer)
        if self.absorb:
            q_latent = torch.einsum("bgrqe,gec->bgrqc", q_nope * self.k_norm.weight, w_uk)
            content = torch.einsum("bgrqc,bnc->bgrqn", q_latent, ckv[:, 0]) * inv_rms[:, :, None, None, :, 0]
        else:
            k_normed = self.k_norm(torch.einsum("bnc,gec->bgne", ckv[:, 0], w_uk))
            content = torch.einsum("bgrqe,bgne->bgrqn", q_nope, k_normed)
        scores = (content + torch.einsum("bgrqd,bnd->bgrqn", q_rope, kr[:, 0])) * scale
        group_pos = k_pos.expand(-1, g, -1)
        probs = softmax_masked(scores, causal_mask(pos, group_pos))  # [B, G, r, q, n]
        cache.note_attention(self.layer, probs)
        o_latent = torch.einsum("bgrqn,bnc->bgrqc", probs, ckv[:, 0]).reshape(x.shape[0], h, x.shape[1], c.latent_dim)
        return self.o_proj(_merge(torch.einsum("bhqc,hvc->bhqv", o_latent, w_uv)))


class PathMLAttention(nn.Module):
    """Cross-layer path on MLA: the path's first layer writes one latent (from its own input); each
    layer writes a K delta (its decoupled RoPE key) and a V delta. Per head
    `k = [W_uk c ; rope(k_delta)]`, `v = [W_uv c ; v_delta]` (materialised). As in MLA, the content
    parts are RMS-normalised before they are cached (the latent and the V delta), the RoPE key is not."""

    def __init__(self, cfg, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.path = layer // cfg.share
        self.writes_latent = layer % cfg.share == 0
        h = cfg.q_heads
        self.q_proj = _linear(cfg.hidden, h * (cfg.nope_dim + cfg.rope_dim))
        if self.writes_latent:
            self.kv_a_proj = _linear(cfg.hidden, cfg.latent_dim)
            self.kv_a_layernorm = RMSNorm(cfg.latent_dim, cfg.norm_eps)
        self.k_delta_proj = _linear(cfg.hidden, cfg.rope_dim)
        self.v_delta_proj = _linear(cfg.hidden, cfg.layer_dim)
        self.v_delta_layernorm = RMSNorm(cfg.layer_dim, cfg.norm_eps)
        self.kv_b_proj = _linear(cfg.latent_dim, h * (cfg.nope_dim + cfg.v_dim))
        self.o_proj = _linear(h * (cfg.v_dim + cfg.layer_dim), cfg.hidden)

    def forward(self, x, pos, cache: RetentionCache):
        c, h = self.cfg, self.cfg.q_heads
        if self.writes_latent:
            cache.append(f"P{self.path}.c_kv", self.kv_a_layernorm(self.kv_a_proj(x))[:, None])
        ckv = cache.read(f"P{self.path}.c_kv")[:, 0]
        kr = cache.append(f"L{self.layer}.delta.k", rope(self.k_delta_proj(x)[:, None], pos, c.rope_theta))
        dv = cache.append(f"L{self.layer}.delta.v", self.v_delta_layernorm(self.v_delta_proj(x))[:, None])
        kv = torch.einsum("bnc,hec->bhne", ckv, self.kv_b_proj.weight.view(h, c.nope_dim + c.v_dim, c.latent_dim))
        k = torch.cat([kv[..., : c.nope_dim], kr.expand(-1, h, -1, -1)], -1)
        v = torch.cat([kv[..., c.nope_dim :], dv.expand(-1, h, -1, -1)], -1)
        q_nope, q_rope = _heads(self.q_proj(x), h).split([c.nope_dim, c.rope_dim], -1)
        q = torch.cat([q_nope, rope(q_rope, pos, c.rope_theta)], -1)
        k_pos = cache.layer_positions(self.layer).expand(-1, h, -1)
        out = attend(q, k, v, pos, k_pos, (c.nope_dim + c.rope_dim) ** -0.5, cache, self.layer)
        return self.o_proj(_merge(out))


ATTENTION = {
    "kv": KVAttention,
    "cla": KVAttention,
    "mla": MLAttention,
    "qk-norm-mla": QKNormMLAttention,
    "path-concat": PathConcatAttention,
    "path-residual": PathResidualAttention,
    "path-mla": PathMLAttention,
}
