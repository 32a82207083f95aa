"""Query statistics of MLA models, for `triattention` and `alpha` on a latent cache.

The scores are derived in `docs/layouts.md` ("TriAttention and alpha on latent caches") and computed by
`retention.policy.scoring.latent`. Per layer `l` and query head `h` they need, over the tokens `t` of a
calibration text (pre-RoPE queries, after any query norm):

    rope_qm[l, h, f]      = E_t[qR_f]        complex mean of the rope query's band f   (`rope_qm_real`, `rope_qm_imag`)
    rope_qa[l, h, f]      = E_t[|qR_f|]      its mean modulus                          (`rope_qa`)
    content_mean[l, h, e] = E_t[qN_e]        mean content query                        (`content_mean`)
    content_qa[l, h, e]   = E_t[|qN_e|]      mean modulus per content dim (optional term) (`content_qa`)

Shapes `[L, H, F]` (`F = d_rope / 2`) and `[L, H, d_nope]`, float32, plus `inv_freq` `[F]`. Bands
pair the rope query's dims as the model's rotation does (`query_interleaved`: `(2f, 2f+1)`, DeepSeek's
complex form and `retention.models.arch.modules.rope`; else `(f, f+F)`); the stored, rotated key may use
another pairing (`key_interleaved`: DeepSeek-V3's interleaved rotation writes its output half-split).

The file is a safetensors file of the same family as the per-head statistics
(`retention.policy.scoring.calibration`): the same metadata entry `retention_stats`, whose JSON adds
`"kind": "latent"` and a latent geometry (family, layers, heads, KV groups, latent/content/rope/value
dims, the band pairings, the RoPE attention factor); `load_latent_stats` refuses a file of another
model, geometry or kind with one line.

Models: the reference `ArchLM` of family `mla` (`tiny-mla`) and `qk-norm-mla` (`tiny-qk-norm-mla`;
statistics of the normalised queries `q_norm(qN)`, `q_rope_norm(qR)`), `DeepseekReference`, and a
transformers DeepSeek-V2/V3 checkpoint (seen through `DeepseekReference`, which shares its weights).
Queries are read with forward hooks on each layer's query projection (`q_proj`, or `q_b_proj` with
compressed queries), whose output is the pre-RoPE query `[.., H * (d_nope + d_rope)]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from retention.errors import RetentionError
from retention.models.arch.configs import TINY
from retention.models.arch.deepseek import SUPPORTED, DeepseekReference
from retention.models.arch.model import ArchLM
from retention.models.arch.modules import MLAttention
from retention.policy.scoring.calibration import (DEFAULT_CHUNK, META_KEY, QueryStats, default_stats_path, load_stats_tensors, save_stats_tensors, stats_meta)
from retention.policy.scoring.latent import rope_bands

KIND = "latent"
TENSORS = ("rope_qm_real", "rope_qm_imag", "rope_qa", "content_mean", "content_qa", "inv_freq")
LATENT_FAMILIES = ("mla", "qk-norm-mla")


@dataclass
class LatentModel:
    """What the latent statistics and scores read from an MLA model.

    attention: per layer its `MLAttention` (or `QKNormMLAttention`); family: `mla` | `qk-norm-mla`;
    inv_freq `[F]` float32: the RoPE frequencies; rope_scale: the factor the rotation multiplies
    both the rope query and key by (YaRN's attention factor; 1 otherwise); query_interleaved /
    key_interleaved: band pairings of the pre-RoPE query and of the stored rotated key; name: the
    model's name for its default statistics path ("" when unknown); run: `run(ids [1, T])` runs a
    forward without a persistent cache (calibration).
    """

    attention: list
    family: str
    q_heads: int
    kv_groups: int
    latent_dim: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    inv_freq: torch.Tensor
    rope_scale: float
    query_interleaved: bool
    key_interleaved: bool
    name: str
    run: Any

    def geometry(self) -> dict[str, Any]:
        return {"family": self.family, "layers": len(self.attention), "q_heads": self.q_heads,
                "kv_groups": self.kv_groups, "latent_dim": self.latent_dim, "nope_dim": self.nope_dim,
                "rope_dim": self.rope_dim, "v_dim": self.v_dim, "query_interleaved": self.query_interleaved,
                "key_interleaved": self.key_interleaved, "rope_scale": self.rope_scale}

    def up_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s `W_UK^T` `[H, r, d_nope]` and `W_UV` `[H, d_v, r]`, per query head.

        QK-norm MLA: the key norm's weight `gamma` is folded in (`W_UK_g^T diag(gamma)`, the group's
        matrix repeated over its `H / G` query heads), so that the content key is this times the
        cached inverse RMS (`QKNormMLAttention`)."""
        attn = self.attention[layer]
        H, r = self.q_heads, self.latent_dim
        if self.family == "qk-norm-mla":
            G = self.kv_groups
            w_uk = attn.k_b_proj.weight.view(G, self.nope_dim, r) * attn.k_norm.weight[None, :, None]
            w_uk = w_uk.repeat_interleave(H // G, dim=0)
            w_uv = attn.v_b_proj.weight.view(H, self.v_dim, r)
        else:
            w_uk, w_uv = attn.up_weights()
        return w_uk.detach().transpose(1, 2), w_uv.detach()


def _rope_inv_freq(theta: float, d: int) -> torch.Tensor:
    """`retention.models.arch.modules.rope`'s frequencies `theta^(-2i/d)`, float32."""
    return (1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()


def _tiny_name(config) -> str:
    return next((name for name, cfg in TINY.items() if cfg == config), "")


def latent_model(model) -> LatentModel | None:
    """The `LatentModel` of an MLA model (see the module doc), None for any other model.

    Raises `RetentionError` for a latent layout nothing is derived on in code (path-on-MLA)."""
    if getattr(getattr(model, "config", None), "model_type", None) in SUPPORTED:
        model = DeepseekReference(model)  # shares every weight of the checkpoint
    if isinstance(model, DeepseekReference):
        hf = model.hf
        rotary = hf.model.rotary_emb
        cfg = model.config
        v3 = hf.config.model_type == "deepseek_v3"
        interleave = bool(getattr(hf.config, "rope_interleave", False)) if v3 else True

        def run(ids):
            hf(input_ids=ids, use_cache=False, logits_to_keep=1)

        return LatentModel(list(model.attention), "mla", cfg.q_heads, 1, cfg.latent_dim, cfg.nope_dim, cfg.rope_dim,
                           cfg.v_dim, rotary.inv_freq.detach().float().cpu(), float(rotary.attention_scaling),
                           query_interleaved=interleave, key_interleaved=not v3,
                           name=getattr(hf.config, "name_or_path", "") or "", run=run)
    if isinstance(model, ArchLM):
        cfg = model.config
        if cfg.family == "path-mla":
            raise RetentionError(f"{_tiny_name(cfg) or 'a path-on-MLA model'}: triattention and alpha on a path-on-MLA "
                                 "cache are derived in docs/layouts.md but not implemented (its latent is shared by "
                                 "the layers of a path, which read it through different up-projections)")
        if cfg.family not in LATENT_FAMILIES:
            return None
        attention = [block.self_attn for block in model.model.layers]
        assert all(isinstance(a, MLAttention) for a in attention)

        def run(ids):
            model(ids, torch.arange(ids.shape[1], device=ids.device)[None], model.new_cache(), logits_to_keep=1)

        return LatentModel(attention, cfg.family, cfg.q_heads, cfg.kv_heads if cfg.family == "qk-norm-mla" else 1,
                           cfg.latent_dim, cfg.nope_dim, cfg.rope_dim, cfg.v_dim,
                           _rope_inv_freq(cfg.rope_theta, cfg.rope_dim), 1.0, query_interleaved=True,
                           key_interleaved=True, name=_tiny_name(cfg), run=run)
    return None


@dataclass
class LatentStats:
    """Latent query statistics of one model (module doc): rope_qm `[L, H, F]` complex64, rope_qa
    `[L, H, F]`, content_mean and content_qa `[L, H, d_nope]`, inv_freq `[F]` (float32), meta."""

    rope_qm: torch.Tensor
    rope_qa: torch.Tensor
    content_mean: torch.Tensor
    content_qa: torch.Tensor
    inv_freq: torch.Tensor
    meta: dict[str, Any]

    def save(self, path: str | Path) -> Path:
        parts = (self.rope_qm.real, self.rope_qm.imag, self.rope_qa, self.content_mean, self.content_qa, self.inv_freq)
        return save_stats_tensors(path, dict(zip(TENSORS, parts, strict=True)), self.meta)

    @classmethod
    def load(cls, path: str | Path) -> LatentStats:
        t, meta = load_stats_tensors(path, TENSORS, kind=KIND)
        return cls(torch.complex(t["rope_qm_real"], t["rope_qm_imag"]), t["rope_qa"], t["content_mean"],
                   t["content_qa"], t["inv_freq"], meta)

    def check_model(self, latent: LatentModel, source: str = "statistics") -> None:
        """Raise `RetentionError` naming every mismatch between these statistics and the model."""
        have, want = self.meta.get("geometry", {}), latent.geometry()
        diffs = [f"{k} {have.get(k)!r} vs model {v!r}" for k, v in want.items() if have.get(k) != v]
        if not diffs and not torch.allclose(latent.inv_freq, self.inv_freq, rtol=1e-6, atol=0):
            diffs.append("rotary inverse frequencies differ")
        if diffs:
            raise RetentionError(f"{source} (calibrated on {self.meta.get('model_id')!r}) do not match this model: "
                                 + "; ".join(diffs) + ". Calibrate this model with `retention calibrate --model ...`")


def calibrate_latent(model, token_ids, *, chunk: int = DEFAULT_CHUNK, model_id: str | None = None,
                     text_source: str = "token ids") -> LatentStats:
    """Latent statistics of the MLA `model` over `token_ids` (`[T]`), in independent chunks of `chunk`
    tokens; sums in float64 per (layer, head, band / content dim)."""
    latent = latent_model(model)
    if latent is None:
        raise RetentionError(f"{type(model).__name__} has no MLA attention: use `retention.policy.scoring.calibration.calibrate`")
    L, H, dn, dr = len(latent.attention), latent.q_heads, latent.nope_dim, latent.rope_dim
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise RetentionError("calibration needs at least one token")
    sums = {k: torch.zeros(L, H, n, dtype=torch.float64)
            for k, n in (("re", dr // 2), ("im", dr // 2), ("mod", dr // 2), ("mean", dn), ("abs", dn))}
    qk_norm = latent.family == "qk-norm-mla"

    def hook_for(layer: int, attn):
        def hook(_module, _inputs, output):
            q_nope, q_rope = output.detach().reshape(-1, H, dn + dr).split([dn, dr], -1)
            if qk_norm:  # the statistics of the queries the scores see: after the query norms
                q_nope, q_rope = attn.q_norm(q_nope), attn.q_rope_norm(q_rope)
            re, im = rope_bands(q_rope.double().cpu(), latent.query_interleaved)
            sums["re"][layer] += re.sum(0)
            sums["im"][layer] += im.sum(0)
            sums["mod"][layer] += torch.hypot(re, im).sum(0)
            q_nope = q_nope.double().cpu()
            sums["mean"][layer] += q_nope.sum(0)
            sums["abs"][layer] += q_nope.abs().sum(0)

        return hook

    handles = []
    try:
        for i, attn in enumerate(latent.attention):
            target = attn.q_b_proj if isinstance(getattr(attn, "q_b_proj", None), torch.nn.Module) else attn.q_proj
            handles.append(target.register_forward_hook(hook_for(i, attn)))
        device = next(model.parameters()).device
        with torch.inference_mode():
            for start in range(0, ids.numel(), chunk):
                latent.run(ids[start:start + chunk].to(device)[None])
    finally:
        for h in handles:
            h.remove()
    n = ids.numel()
    meta = stats_meta(model, ids, model_id or latent.name or type(model).__name__, latent.geometry(), chunk,
                      text_source, kind=KIND)
    s = {k: v / n for k, v in sums.items()}
    return LatentStats(torch.complex(s["re"], s["im"]).to(torch.complex64), s["mod"].float(), s["mean"].float(),
                       s["abs"].float(), latent.inv_freq, meta)


def load_latent_stats(path: str | Path | None, model, latent: LatentModel | None = None) -> LatentStats:
    """Latent statistics for the MLA `model` from `path` (None: its default location), checked against it."""
    latent = latent or latent_model(model)
    if latent is None:
        raise RetentionError(f"{type(model).__name__} has no MLA attention: its statistics are per-head")
    if path is None:
        if not latent.name:
            raise RetentionError("this model has no name to find its default calibration statistics by; pass --stats "
                                 "FILE (written by `retention calibrate --model ... --out FILE`)")
        path = default_stats_path(latent.name)
        if not path.is_file():
            raise RetentionError(f"no calibration statistics at {path}; run `retention calibrate --model "
                                 f"{latent.name}` first (or pass --stats FILE)")
    elif not Path(path).is_file():
        raise RetentionError(f"no calibration statistics at {path}; run `retention calibrate --model MODEL --out "
                             f"{path}` first")
    stats = LatentStats.load(path)
    stats.check_model(latent, source=f"statistics {path}")
    return stats


def read_stats_file(path: str | Path):
    """A statistics file of either kind, read without a model: `LatentStats` when its metadata says
    `"kind": "latent"`, else `retention.policy.scoring.calibration.QueryStats` (one error line when it is neither)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            kind = json.loads((f.metadata() or {}).get(META_KEY, "{}")).get("kind")
    except (ValueError, OSError, AttributeError, json.JSONDecodeError, SafetensorError) as exc:
        raise RetentionError(f"{path} is not a retention statistics file ({type(exc).__name__}: {exc})") from None
    return (LatentStats if kind == KIND else QueryStats).load(path)
