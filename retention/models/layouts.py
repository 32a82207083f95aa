"""Cache layouts as data: what each layer stores per token, from which elements and bytes follow.

A layout is a list of `Store`s. A store is one tensor kept per cached token, `heads x dim` elements,
written once and read by one or more layers (`readers`): a layer's own K or V (MHA/GQA/MQA), a K/V
pair read by a whole group of layers (CLA), an MLA latent `c_kv` and its decoupled RoPE key, the
shared "alpha" component of a cross-layer path and its per-layer "delta"s, or a per-token scalar
(the cached inverse RMS of a QK-normalised MLA). Layers that read a common store form a *sharing
group*; retention keeps one set of tokens per group, since a token dropped from a shared store is
gone for every layer that reads it.

Sizes here are the compressed representation (what must be kept per token), not peak runtime
allocations (`CacheLayout.counts` says so in every record). The documented layouts of
`../shared/docs/cache-audit.md` are in `DOCUMENTED`, each built from its stated geometry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from retention.dtypes import dtype_bytes
from retention.errors import RetentionError

DEFAULT_ROPE_THETA = 10_000.0
COUNTS = "compressed representation (elements kept per token), not allocated buffers"


@dataclass(frozen=True)
class Store:
    """One tensor kept per cached token: `heads x dim` elements, read by the layers `readers`.

    Its writer is the first reader (`readers[0]`); a store read by one layer is private to it.
    """

    name: str
    heads: int
    dim: int
    readers: tuple[int, ...]

    @property
    def elements(self) -> int:
        return self.heads * self.dim

    @property
    def writer(self) -> int:
        return self.readers[0]


@dataclass(frozen=True)
class CacheLayout:
    """What one token costs in the cache of a whole model, and who shares what.

    `stores` describe the cache; `layers`, `q_heads`, `kv_heads` (heads per stored token: the
    eviction unit count, 1 for an MLA latent) and `head_dim` (the query-key dot-product width)
    describe attention for scorers and calibration; `rope_theta`/`rope_scaling` its RoPE.
    """

    name: str
    family: str  # kv | mla | cla | path-concat | path-residual | path-mla
    layers: int
    stores: tuple[Store, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    formula: str = ""
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    dtype_bytes: int = 2

    @property
    def is_latent(self) -> bool:
        return self.family in ("mla", "path-mla")

    @property
    def provides(self) -> frozenset[str]:
        """What the stores hold for scorers (`retention.policy.registry.READS`): per-head keys and values
        (`kv`), an MLA latent (`mla`, `path-mla`), neither for stores shared across layers."""
        if self.family == "kv":
            return frozenset({"positions", "keys", "values"})
        return frozenset({"positions", "latent"} if self.is_latent else {"positions"})

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token, whole model (K and V, latents, RoPE keys, scalars)."""
        return sum(s.elements for s in self.stores)

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * self.dtype_bytes

    @property
    def kib_per_token(self) -> float:
        return self.bytes_per_token / 1024

    def cache_bytes(self, tokens: int, batch: int = 1) -> int:
        """Bytes held by `tokens` cached tokens in each of `batch` sequences."""
        return self.bytes_per_token * tokens * batch

    def layer_elements(self) -> list[int]:
        """Elements per token that each layer writes (a shared store counts at its writer)."""
        out = [0] * self.layers
        for s in self.stores:
            out[s.writer] += s.elements
        return out

    def groups(self) -> list[tuple[int, ...]]:
        """Sharing groups: the layers connected by common stores, in layer order."""
        parent = list(range(self.layers))

        def root(i: int) -> int:
            while parent[i] != i:
                i = parent[i]
            return i

        for s in self.stores:
            for r in s.readers[1:]:
                parent[root(r)] = root(s.readers[0])
        members: dict[int, list[int]] = {}
        for layer in range(self.layers):
            members.setdefault(root(layer), []).append(layer)
        return sorted((tuple(m) for m in members.values()), key=lambda m: m[0])

    def with_dtype(self, dtype: str | torch.dtype) -> CacheLayout:
        return replace(self, dtype_bytes=dtype_bytes(dtype))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (run records, `retention audit --json`)."""
        return {
            "name": self.name,
            "family": self.family,
            "formula": self.formula,
            "layers": self.layers,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "dtype_bytes": self.dtype_bytes,
            "elements_per_token": self.elements_per_token,
            "bytes_per_token": self.bytes_per_token,
            "kib_per_token": self.kib_per_token,
            "layer_elements": self.layer_elements(),
            "sharing_groups": [list(g) for g in self.groups()],
            "counts": COUNTS,
        }

    # Kept for callers of the former `CacheGeometry.from_config`.
    @classmethod
    def from_config(cls, config: Any, dtype: str | torch.dtype = "bfloat16") -> CacheLayout:
        return layout_from_config(config, dtype)


# The name this replaced; same fields for per-layer K/V models.
CacheGeometry = CacheLayout


# --------------------------------------------------------------------------------------------
# Constructors, one per family
# --------------------------------------------------------------------------------------------


def kv(layers: int, kv_heads: int, head_dim: int, *, q_heads: int | None = None, name: str = "") -> CacheLayout:
    """MHA/GQA/MQA: every layer stores its own K and V, `kv_heads x head_dim` each."""
    stores = tuple(
        Store(f"L{i}.{part}", kv_heads, head_dim, (i,)) for i in range(layers) for part in ("k", "v")
    )
    return CacheLayout(
        name or f"kv-{layers}x{kv_heads}x{head_dim}", "kv", layers, stores, q_heads or kv_heads, kv_heads, head_dim,
        formula=f"2*{layers}*{kv_heads}*{head_dim}",
    )


def mla(
    layers: int, latent_dim: int, rope_key_dim: int, *, q_heads: int = 1, qk_norm_groups: int = 0, name: str = ""
) -> CacheLayout:
    """MLA: per layer one latent `c_kv` (`latent_dim`) and one decoupled RoPE key (`rope_key_dim`),
    shared by all heads (one "head" per token). A QK-normalised MLA also caches the key's inverse
    RMS, one scalar per token per KV group: `qk_norm_groups` extra elements per layer."""
    stores: list[Store] = []
    for i in range(layers):
        stores += [Store(f"L{i}.c_kv", 1, latent_dim, (i,)), Store(f"L{i}.k_rope", 1, rope_key_dim, (i,))]
        if qk_norm_groups:
            stores.append(Store(f"L{i}.inv_rms", qk_norm_groups, 1, (i,)))
    extra = f"+{qk_norm_groups}" if qk_norm_groups else ""
    return CacheLayout(
        name or f"mla-{latent_dim}-{rope_key_dim}", "mla", layers, tuple(stores), q_heads, 1,
        latent_dim + rope_key_dim, formula=f"{layers}*({latent_dim}+{rope_key_dim}{extra})",
    )


def _paths(layers: int, length: int) -> list[tuple[int, ...]]:
    """Consecutive groups of `length` layers; the last one is shorter when `length` does not divide
    `layers` (path length 8 on 12 layers: paths of 8 and 4, P = 2 as the audit counts)."""
    if length <= 0:
        raise RetentionError(f"a layer group needs a positive length, not {length}")
    return [tuple(range(p, min(p + length, layers))) for p in range(0, layers, length)]


def cla(layers: int, share: int, kv_heads: int, head_dim: int, *, q_heads: int | None = None, name: str = "") -> CacheLayout:
    """CLA: the first layer of each group of `share` layers writes K and V; the group reads them."""
    paths = _paths(layers, share)
    stores = tuple(Store(f"G{g}.{part}", kv_heads, head_dim, path) for g, path in enumerate(paths) for part in ("k", "v"))
    return CacheLayout(
        name or f"cla-{share}", "cla", layers, stores, q_heads or kv_heads, kv_heads, head_dim,
        formula=f"2*{len(paths)}*{kv_heads}*{head_dim}",
    )


def path_concat(
    layers: int, length: int, kv_heads: int, shared_dim: int, layer_dim: int, *, q_heads: int | None = None,
    name: str = "",
) -> CacheLayout:
    """Cross-layer path, concat: per path one shared alpha K/V (`shared_dim` per head), per layer a
    delta K/V (`layer_dim` per head); a layer attends with `[alpha ; delta]` per head."""
    paths = _paths(layers, length)
    stores = [Store(f"P{p}.alpha.{part}", kv_heads, shared_dim, path) for p, path in enumerate(paths) for part in "kv"]
    stores += [Store(f"L{i}.delta.{part}", kv_heads, layer_dim, (i,)) for i in range(layers) for part in "kv"]
    return CacheLayout(
        name or f"path-concat-{length}-{shared_dim}-{layer_dim}", "path-concat", layers, tuple(stores),
        q_heads or kv_heads, kv_heads, shared_dim + layer_dim,
        formula=f"2*{kv_heads}*({len(paths)}*{shared_dim}+{layers}*{layer_dim})",
    )


def path_residual(
    layers: int, length: int, kv_heads: int, first_dim: int, delta_dim: int, *, q_heads: int | None = None,
    name: str = "",
) -> CacheLayout:
    """Cross-layer path, residual: the path's first layer writes full K/V (`first_dim` per head);
    each later layer writes a `delta_dim` delta that it expands and adds to the previous layer's
    K/V (so a delta is read by its layer and every later layer of the path)."""
    stores: list[Store] = []
    for p, path in enumerate(_paths(layers, length)):
        stores += [Store(f"P{p}.base.{part}", kv_heads, first_dim, path) for part in "kv"]
        for j, layer in enumerate(path[1:], start=1):
            stores += [Store(f"L{layer}.delta.{part}", kv_heads, delta_dim, path[j:]) for part in "kv"]
    n_paths = len(_paths(layers, length))
    return CacheLayout(
        name or f"path-residual-{length}-{first_dim}-{delta_dim}", "path-residual", layers, tuple(stores),
        q_heads or kv_heads, kv_heads, first_dim,
        formula=f"2*{kv_heads}*({n_paths}*{first_dim}+{layers - n_paths}*{delta_dim})",
    )


def path_mla(
    layers: int, length: int, latent_dim: int, k_delta: int, v_delta: int, *, q_heads: int = 1, name: str = ""
) -> CacheLayout:
    """Cross-layer path on MLA: one `latent_dim` latent per path, per layer a K delta (`k_delta`,
    the layer's decoupled RoPE key) and a V delta (`v_delta`), all shared by the layer's heads."""
    paths = _paths(layers, length)
    stores = [Store(f"P{p}.c_kv", 1, latent_dim, path) for p, path in enumerate(paths)]
    stores += [Store(f"L{i}.delta.{part}", 1, dim, (i,)) for i in range(layers) for part, dim in (("k", k_delta), ("v", v_delta))]
    return CacheLayout(
        name or f"path-mla-{length}-{latent_dim}", "path-mla", layers, tuple(stores), q_heads, 1, latent_dim + k_delta,
        formula=f"{len(paths)}*{latent_dim}+{layers}*({k_delta}+{v_delta})",
    )


# --------------------------------------------------------------------------------------------
# From a transformers config (or a config.json dict)
# --------------------------------------------------------------------------------------------


def layout_from_config(config: Any, dtype: str | torch.dtype = "bfloat16") -> CacheLayout:
    """The layout of a model config: an `ArchConfig` of `retention.models.arch`, a DeepSeek-V2/V3 config
    (`kv_lora_rank`, `qk_rope_head_dim`: MLA), or a per-layer K/V decoder config.

    `num_key_value_heads` defaults to `num_attention_heads` (MHA); `head_dim` defaults to
    `hidden_size // num_attention_heads`. RoPE comes from `rope_parameters` (transformers 5.x,
    where `rope_theta` lives inside it and `rope_scaling` is only a deprecated alias of it) or
    from the legacy top-level `rope_theta` / `rope_scaling` (4.x configs and raw config.json).
    `rope_scaling` is None for plain RoPE, else the scaling parameters without `rope_theta`.
    """
    own = getattr(config, "cache_layout", None)
    if callable(own):
        return own().with_dtype(dtype)
    cfg = _text_config(config)
    layers = _field(cfg, "num_hidden_layers")
    q_heads = _field(cfg, "num_attention_heads")
    if layers is None or q_heads is None:
        raise RetentionError(
            "model config has no num_hidden_layers/num_attention_heads: not a decoder-only transformer config"
        )
    rope_theta, rope_scaling = _rope_from_config(cfg)
    name = str(_field(cfg, "model_type") or "model")
    latent = _field(cfg, "kv_lora_rank")
    if latent:
        layout = mla(int(layers), int(latent), int(_field(cfg, "qk_rope_head_dim")), q_heads=int(q_heads), name=name)
    else:
        kv_heads = _field(cfg, "num_key_value_heads") or q_heads
        head_dim = _field(cfg, "head_dim")
        if not head_dim:
            hidden = _field(cfg, "hidden_size")
            if hidden is None:
                raise RetentionError("model config has neither head_dim nor hidden_size")
            head_dim = hidden // q_heads
        layout = kv(int(layers), int(kv_heads), int(head_dim), q_heads=int(q_heads), name=name)
    return replace(layout, rope_theta=rope_theta, rope_scaling=rope_scaling, dtype_bytes=dtype_bytes(dtype))


def _field(cfg: Any, key: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key)
    return getattr(cfg, key, None)


def _text_config(config: Any) -> Any:
    """The decoder's config: multimodal configs nest it under `text_config`."""
    if isinstance(config, Mapping):
        return config.get("text_config") or config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _rope_from_config(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    params = _field(cfg, "rope_parameters")
    if isinstance(params, Mapping) and params:
        # Models with several attention types nest one dict per layer type; the cache meter cares
        # about the full-attention layers.
        nested = {k: v for k, v in params.items() if isinstance(v, Mapping)}
        if nested and len(nested) == len(params):
            params = nested.get("full_attention") or next(iter(nested.values()))
        theta = params.get("rope_theta") or _field(cfg, "rope_theta") or DEFAULT_ROPE_THETA
        scaling: Any = params
    else:
        theta = _field(cfg, "rope_theta") or DEFAULT_ROPE_THETA
        scaling = _field(cfg, "rope_scaling")
    if not isinstance(scaling, Mapping):
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return float(theta), None
    return float(theta), {k: v for k, v in scaling.items() if k != "rope_theta"}


# --------------------------------------------------------------------------------------------
# The documented layouts (../shared/docs/cache-audit.md, ../shared/docs/models.md)
# --------------------------------------------------------------------------------------------


def _documented() -> dict[str, CacheLayout]:
    rows = [
        kv(12, 12, 64, q_heads=12, name="mha"),
        kv(12, 4, 64, q_heads=8, name="gqa"),
        kv(12, 1, 64, q_heads=12, name="mqa"),
        kv(28, 4, 128, q_heads=28, name="r1-distill-qwen-7b"),
        kv(32, 8, 128, q_heads=32, name="r1-distill-llama-8b"),
        kv(30, 3, 64, q_heads=9, name="smollm2-135m"),
        mla(12, 256, 16, name="mla-256-16"),
        mla(12, 128, 32, q_heads=8, name="mla"),
        cla(12, 4, 4, 256, q_heads=8, name="cla"),
        path_concat(12, 4, 4, 128, 32, q_heads=8, name="path-concat"),
        path_residual(12, 4, 4, 160, 32, q_heads=8, name="path-residual"),
        path_mla(12, 4, 384, 32, 32, q_heads=8, name="path-mla"),
    ]
    rows += [path_concat(12, p, 4, 128, 32, q_heads=8, name=f"path-length-{p}") for p in (2, 8, 12)]
    rows += [path_concat(12, 4, 4, 128, d, q_heads=8, name=f"path-dim-{d}") for d in (16, 64)]
    rows += [mla(12, 128, 32, q_heads=8, qk_norm_groups=8, name="qk-norm-mla")]
    return {layout.name: layout for layout in rows}


DOCUMENTED: dict[str, CacheLayout] = _documented()


def tokens_for_bytes(layout: CacheLayout, budget_bytes: int) -> int:
    """The token budget that `budget_bytes` of stored representation per sequence buys (floor), so
    that layouts compare at matched memory; a token budget checked by the meter is then a byte check."""
    tokens = int(budget_bytes // layout.bytes_per_token)
    if tokens < 1:
        raise RetentionError(
            f"a budget of {budget_bytes:g} bytes holds no token of {layout.name} ({layout.bytes_per_token} bytes per token)"
        )
    return tokens


def named_layout(name: str) -> CacheLayout:
    try:
        return DOCUMENTED[name]
    except KeyError:
        raise RetentionError(f"unknown layout {name!r}: use one of {', '.join(DOCUMENTED)}") from None
