"""Architectures as data: one `ArchConfig` per layout family, the documented configurations.

The parameter counts of `../shared/docs` (issue 14) are reproduced by counting the parameters of
`ArchLM` built from these configurations on the meta device (`retention.models.arch.model.count_parameters`,
no memory, no weights): nothing here states a count. This module imports nothing from the model
(the model is built from these configurations, never the reverse). Where a document gives a count
but not the whole structure behind it, the record says what was derived and by which rule
(`PARAMETER_NOTES`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from retention.models.layouts import (
    CacheLayout,
    cla,
    kv,
    mla,
    path_concat,
    path_mla,
    path_residual,
)

FAMILIES = ("kv", "cla", "mla", "qk-norm-mla", "path-concat", "path-residual", "path-mla")


@dataclass(frozen=True)
class ArchConfig:
    """A decoder: `layers` blocks of pre-RMSNorm attention + SwiGLU (`ffn` wide), embeddings untied
    unless `tie_embeddings`.

    kv/cla: `kv_heads x head_dim` K/V, shared by groups of `share` layers (kv: share 1).
    path-concat: per path of `share` layers an alpha of `shared_dim`, per layer a delta of
    `layer_dim` per head (head dim = shared_dim + layer_dim). path-residual: the path's first layer
    `head_dim`, later layers a `layer_dim` delta expanded per head to `head_dim`.
    mla / qk-norm-mla: latent `latent_dim`, RoPE key `rope_dim`, per head `nope_dim` content key
    and `v_dim` value (mla: queries optionally through a `q_lora_rank` latent); qk-norm-mla
    normalises keys per `kv_heads` groups. path-mla: one `latent_dim` latent per path, per layer a
    `rope_dim` K delta (its RoPE key) and a `layer_dim` V delta.
    """

    family: str
    layers: int = 4
    hidden: int = 64
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    vocab: int = 259
    ffn: int = 128
    share: int = 1
    shared_dim: int = 0
    layer_dim: int = 0
    latent_dim: int = 0
    rope_dim: int = 0
    nope_dim: int = 0
    v_dim: int = 0
    q_lora_rank: int = 0  # mla: queries through a compressed latent of this width (DeepSeek-V3); 0: none
    tie_embeddings: bool = False  # the LM head reuses the input embedding (GPT-2-style shapes)
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    init_range: float = 0.2

    # What transformers-style callers read.
    @property
    def num_hidden_layers(self) -> int:
        return self.layers

    @property
    def num_attention_heads(self) -> int:
        return self.q_heads

    def get_text_config(self) -> ArchConfig:
        return self

    def cache_layout(self) -> CacheLayout:
        """The layout this architecture's cache stores (float32 elements until `with_dtype`)."""
        f, n = self.family, self.layers
        if f == "kv":
            layout = kv(n, self.kv_heads, self.head_dim, q_heads=self.q_heads)
        elif f == "cla":
            layout = cla(n, self.share, self.kv_heads, self.head_dim, q_heads=self.q_heads)
        elif f == "mla":
            layout = mla(n, self.latent_dim, self.rope_dim, q_heads=self.q_heads)
        elif f == "qk-norm-mla":
            layout = mla(n, self.latent_dim, self.rope_dim, q_heads=self.q_heads, qk_norm_groups=self.kv_heads)
        elif f == "path-concat":
            layout = path_concat(n, self.share, self.kv_heads, self.shared_dim, self.layer_dim, q_heads=self.q_heads)
        elif f == "path-residual":
            layout = path_residual(n, self.share, self.kv_heads, self.head_dim, self.layer_dim, q_heads=self.q_heads)
        elif f == "path-mla":
            layout = path_mla(n, self.share, self.latent_dim, self.rope_dim, self.layer_dim, q_heads=self.q_heads)
        else:
            raise ValueError(f"unknown family {f!r}: one of {FAMILIES}")
        return replace(layout, name=f"tiny-{f}" if self.layers == 4 else layout.name, rope_theta=self.rope_theta,
                       dtype_bytes=4)


# --------------------------------------------------------------------------------------------
# The documented configurations (issue 14: 12 layers, hidden 512, 8 query / 4 KV heads,
# vocabulary 50,304, untied embeddings, SwiGLU widths 2048 / 1024 / 1536 / 1516)
# --------------------------------------------------------------------------------------------

_BASE = dict(layers=12, hidden=512, q_heads=8, kv_heads=4, vocab=50_304)

DOCUMENTED_CONFIGS: dict[str, ArchConfig] = {
    "gqa": ArchConfig("kv", head_dim=64, ffn=2048, **_BASE),
    "cla": ArchConfig("cla", head_dim=256, share=4, ffn=1024, **_BASE),
    "path-concat": ArchConfig("path-concat", share=4, shared_dim=128, layer_dim=32, head_dim=160, ffn=1536, **_BASE),
    "path-residual": ArchConfig("path-residual", share=4, head_dim=160, layer_dim=32, ffn=1516, **_BASE),
    # The 1,920-element MLA row (latent 128, RoPE key 32), 8 heads of 64 content-key / 64 value dims.
    "mla": ArchConfig("mla", latent_dim=128, rope_dim=32, nope_dim=64, v_dim=64, ffn=2048, **_BASE),
    # The path-on-MLA cache row. Its projections are this module's design (`PathMLAttention`); its
    # SwiGLU width is not stated, so it follows the documents' rule for the other variants (GQA, CLA
    # and both paths share one total through their widths): match MLA's total. With the content
    # parts normalised as in MLA (latent and V delta; not the RoPE key) that width is an integer,
    # 1792 (`PARAMETER_NOTES`).
    "path-mla": ArchConfig("path-mla", share=4, latent_dim=384, rope_dim=32, layer_dim=32, nope_dim=64, v_dim=64,
                           ffn=1792, **_BASE),
    **{f"path-length-{p}": ArchConfig("path-concat", share=p, shared_dim=128, layer_dim=32, head_dim=160, ffn=1536,
                                      **_BASE) for p in (2, 8, 12)},
    **{f"path-dim-{d}": ArchConfig("path-concat", share=4, shared_dim=128, layer_dim=d, head_dim=128 + d, ffn=1536,
                                   **_BASE) for d in (16, 64)},
}

# The figures the documents state (issue 14), by layout name.
DOCUMENTED_PARAMETERS: dict[str, int] = {
    "gqa": 98_710_016, "cla": 98_710_016, "path-concat": 98_710_016, "path-residual": 98_710_016,
    "mla": 99_694_592, "path-mla": 99_694_592,
    "path-length-2": 100_282_880, "path-length-8": 98_185_728, "path-length-12": 97_661_440,
    "path-dim-16": 96_350_720, "path-dim-64": 103_428_608,
}

PARAMETER_NOTES: dict[str, str] = {
    "path-mla": (
        "derived, not stated: the documents give the cache (one 384 latent per 4-layer path, per-layer K and V deltas "
        "of 32) and the total; the projections are this module's (per-layer up-projection of the path latent to "
        "8 heads x (64 + 64), the K delta as the RoPE key, the V delta concatenated per head, the latent and V delta "
        "RMS-normalised as MLA normalises its latent) and the SwiGLU width, 1792, is the one that matches MLA's "
        "total, as the documents match the other variants through their widths"
    ),
}


# Tiny random configurations (4 layers, hidden 64), one per family, for tests and `retention audit`.
TINY: dict[str, ArchConfig] = {
    "tiny-kv": ArchConfig("kv"),
    "tiny-cla": ArchConfig("cla", share=2),
    "tiny-mla": ArchConfig("mla", latent_dim=24, rope_dim=8, nope_dim=16, v_dim=16),
    "tiny-qk-norm-mla": ArchConfig("qk-norm-mla", latent_dim=24, rope_dim=8, nope_dim=16, v_dim=16),
    "tiny-path-concat": ArchConfig("path-concat", share=2, shared_dim=12, layer_dim=4, head_dim=16),
    "tiny-path-residual": ArchConfig("path-residual", share=2, head_dim=16, layer_dim=4),
    "tiny-path-mla": ArchConfig("path-mla", share=2, latent_dim=32, rope_dim=8, layer_dim=8, nope_dim=16, v_dim=16),
}
