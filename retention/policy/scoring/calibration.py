"""Pre-RoPE query statistics for the query-free scorers (`triattention`, `alpha`).

For every layer `l`, query head `h` and RoPE band `f` (band `f` pairs dims `f` and `f + F`, `F = d/2`,
as transformers' `rotate_half` does; complex `q_f = q[f] + i q[f+F]`):

    Qm[l, h, f] = E_t[q_f]      complex mean            (stored as `qm_real`, `qm_imag`)
    Qa[l, h, f] = E_t[|q_f|]    mean modulus            (stored as `qa`)

over the tokens `t` of a calibration text. Queries are taken with forward hooks on each attention
module's `q_proj` (or on its `q_norm`, for models that normalise queries per head, e.g. Qwen3): that
is after any q-norm and before RoPE. Sums are accumulated in float64 and stored as float32.

The calibration text is tokenised once (the tokenizer's default special tokens included), cut to
the requested number of tokens and run as consecutive independent sequences of at most `chunk`
tokens (no cache). The command's default text is the dev split's problems, each followed by its
reference solution (never the confirm split); `--text FILE` uses any UTF-8 file instead.

File format: safetensors with tensors `qm_real`, `qm_imag`, `qa` (`[L, Hq, F]` float32) and
`inv_freq` (`[F]`, the model's rotary inverse frequencies), and one metadata entry
`retention_stats` holding JSON: format version, model id, geometry (layers, q_heads, kv_heads,
head_dim), rope theta and scaling, the model dtype, the number of tokens, the sha256 of the token
ids (little-endian int64 bytes), the text source and the library version. `load_stats` refuses a
file whose geometry or RoPE does not match the model it is loaded for.

MLA models have their own statistics (`retention.policy.scoring.calibration_latent`: same file family, metadata
`"kind": "latent"`); each loader refuses the other's files with one line.

Default location: `<cache root>/stats/<model-name>.safetensors`, with the cache root
`$RETENTION_CACHE_DIR` or the platform's user cache directory (the same root as the model cache).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from retention import __version__
from retention.errors import RetentionError
from retention.models import ALIASES, CacheGeometry, cache_root

STATS_FORMAT = 1
META_KEY = "retention_stats"
DEFAULT_TOKENS = 8192
DEFAULT_CHUNK = 2048
GEOMETRY_KEYS = ("layers", "q_heads", "kv_heads", "head_dim", "rope_theta", "rope_scaling")


# --------------------------------------------------------------------------------------------
# Model introspection
# --------------------------------------------------------------------------------------------


def model_geometry(model) -> dict[str, Any]:
    """Layers, query/KV heads, head dim, RoPE theta and scaling of a decoder model (JSON-ready)."""
    g = CacheGeometry.from_config(model.config)
    return {
        "layers": g.layers,
        "q_heads": g.q_heads,
        "kv_heads": g.kv_heads,
        "head_dim": g.head_dim,
        "rope_theta": g.rope_theta,
        "rope_scaling": _jsonable(g.rope_scaling),
    }


def _jsonable(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str)) if obj is not None else None


def attention_modules(model) -> list:
    """The self-attention module of every decoder layer, in layer order (modules with `q_proj` and
    `layer_idx`). Raises `RetentionError` for models without a separate query projection."""
    found = {}
    for m in model.modules():
        if hasattr(m, "q_proj") and isinstance(getattr(m, "layer_idx", None), int):
            found.setdefault(m.layer_idx, m)
    layers = model.config.get_text_config().num_hidden_layers
    if sorted(found) != list(range(layers)):
        raise RetentionError(
            f"{type(model).__name__}: found query projections for layers {sorted(found)}, expected 0..{layers - 1}; "
            "query statistics need one `q_proj` per attention layer"
        )
    return [found[i] for i in range(layers)]


def rotary_inv_freq(model) -> torch.Tensor:
    """The rotary inverse frequencies `[F]` (float32) the model applies, any llama3/YaRN scaling included.

    Only full-width rotary embeddings (`F = head_dim / 2`) are supported: the band pairing of the
    statistics assumes every dim pair rotates.
    """
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        rotary = next((m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)), None)
    if rotary is None:
        raise RetentionError(f"{type(model).__name__} has no rotary embedding (inv_freq); query statistics need RoPE")
    inv_freq = rotary.inv_freq.detach().float().cpu()
    head_dim = model_geometry(model)["head_dim"]
    if inv_freq.numel() * 2 != head_dim:
        raise RetentionError(
            f"partial rotary embeddings are not supported: {inv_freq.numel()} rotary bands for head dim {head_dim}"
        )
    return inv_freq


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


@dataclass
class QueryStats:
    """Pre-RoPE query statistics of one model.

    qm: `[L, Hq, F]` complex64, `E[q_f]`; qa: `[L, Hq, F]` float32, `E[|q_f|]`;
    inv_freq: `[F]` float32, the rotary inverse frequencies of the calibrated model; meta: see module doc.
    """

    qm: torch.Tensor
    qa: torch.Tensor
    inv_freq: torch.Tensor
    meta: dict[str, Any]

    def save(self, path: str | Path) -> Path:
        tensors = {"qm_real": self.qm.real, "qm_imag": self.qm.imag, "qa": self.qa, "inv_freq": self.inv_freq}
        return save_stats_tensors(path, tensors, self.meta)

    @classmethod
    def load(cls, path: str | Path) -> QueryStats:
        t, meta = load_stats_tensors(path, ("qm_real", "qm_imag", "qa", "inv_freq"), kind=None)
        return cls(torch.complex(t["qm_real"], t["qm_imag"]), t["qa"], t["inv_freq"], meta)

    def check_model(self, model, source: str = "statistics") -> None:
        """Raise `RetentionError` naming every mismatch between these statistics and `model`."""
        have = self.meta.get("geometry", {})
        want = model_geometry(model)
        diffs = [f"{k} {have.get(k)!r} vs model {want[k]!r}" for k in GEOMETRY_KEYS if have.get(k) != want[k]]
        if not diffs:
            inv = rotary_inv_freq(model)
            if inv.shape != self.inv_freq.shape or not torch.allclose(inv, self.inv_freq, rtol=1e-6, atol=0):
                diffs.append("rotary inverse frequencies differ")
        if diffs:
            raise RetentionError(
                f"{source} (calibrated on {self.meta.get('model_id')!r}) do not match this model: "
                + "; ".join(diffs)
                + ". Calibrate this model with `retention calibrate --model ...`"
            )


# What each kind of statistics file holds, for the one line that refuses the other kind.
_KIND_TEXT = {None: "per-head query statistics", "latent": "latent (MLA) statistics"}


def save_stats_tensors(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write statistics `tensors` (float32) and `meta` (JSON under `META_KEY`) to a safetensors file,
    atomically: never leave a half-written stats file where a run would find it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: t.float().contiguous() for k, t in tensors.items()}, str(tmp),
              metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    tmp.replace(path)
    return path


def load_stats_tensors(path: str | Path, names, kind: str | None) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors `names` and the metadata of a statistics file of `kind` (None: per-head, "latent");
    one `RetentionError` line for a missing file, a file of the other kind or not a statistics file."""
    path = Path(path)
    if not path.is_file():
        raise RetentionError(f"no calibration statistics at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            found = meta.get("kind")
            if found != kind:
                raise RetentionError(
                    f"{path} holds {_KIND_TEXT.get(found, repr(found))} (of {meta.get('model_id')!r}), not the "
                    f"{_KIND_TEXT[kind]} this model needs; calibrate this model with `retention calibrate --model ...`")
            tensors = {k: f.get_tensor(k) for k in names}
    except (KeyError, ValueError, OSError, json.JSONDecodeError, SafetensorError) as exc:
        raise RetentionError(f"{path} is not a retention statistics file ({type(exc).__name__}: {exc})") from None
    return tensors, meta


def stats_meta(model, ids: torch.Tensor, model_id: str, geometry: dict, chunk: int, text_source: str,
               **kind) -> dict:
    """The metadata of a statistics file: format, model and geometry, the calibration text's tokens
    (`ids`, `[T]`) and their sha256, version and time; `kind` adds `kind="latent"`."""
    return {
        "format": STATS_FORMAT,
        **kind,
        "model_id": model_id,
        "geometry": geometry,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "tokens": ids.numel(),
        "chunk": chunk,
        "tokens_sha256": tokens_sha256(ids),
        "text_source": text_source,
        "retention_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def tokens_sha256(token_ids: torch.Tensor | list[int]) -> str:
    """sha256 of the token ids as little-endian int64 bytes."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def calibrate(
    model,
    token_ids: torch.Tensor | list[int],
    *,
    chunk: int = DEFAULT_CHUNK,
    model_id: str | None = None,
    text_source: str = "token ids",
) -> QueryStats:
    """Query statistics of `model` over `token_ids` (`[T]`), run in independent chunks of `chunk` tokens.

    Hooks each layer's `q_norm` if it has one, else its `q_proj`, and accumulates in float64:
    `sum_t q_f` and `sum_t |q_f|` per (layer, query head, band).
    """
    geo = model_geometry(model)
    L, Hq, d = geo["layers"], geo["q_heads"], geo["head_dim"]
    F = d // 2
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise RetentionError("calibration needs at least one token")
    inv_freq = rotary_inv_freq(model)
    sum_re = torch.zeros(L, Hq, F, dtype=torch.float64)
    sum_im = torch.zeros_like(sum_re)
    sum_abs = torch.zeros_like(sum_re)

    def hook_for(layer: int):
        def hook(_module, _inputs, output):
            q = output.detach().reshape(-1, Hq, d).double().cpu()  # [tokens, Hq, d]
            re, im = q[..., :F], q[..., F:]
            sum_re[layer] += re.sum(0)
            sum_im[layer] += im.sum(0)
            sum_abs[layer] += torch.hypot(re, im).sum(0)

        return hook

    handles = []
    try:
        for i, attn in enumerate(attention_modules(model)):
            target = attn.q_norm if isinstance(getattr(attn, "q_norm", None), torch.nn.Module) else attn.q_proj
            handles.append(target.register_forward_hook(hook_for(i)))
        device = next(model.parameters()).device
        with torch.inference_mode():
            for start in range(0, ids.numel(), chunk):
                part = ids[start:start + chunk].to(device)[None]
                # logits_to_keep=1: the vocabulary projection of every token is not needed.
                model(input_ids=part, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    n = ids.numel()
    qm = torch.complex(sum_re / n, sum_im / n).to(torch.complex64)
    model_id = model_id or getattr(model.config, "name_or_path", "") or type(model).__name__
    meta = stats_meta(model, ids, model_id, geo, chunk, text_source)
    return QueryStats(qm, (sum_abs / n).float(), inv_freq, meta)


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def stats_name(model_name: str) -> str:
    """File stem for a model name as given to `--model`: its alias (a hub id of an alias maps to the
    alias), else the last component of the path or hub id, with unusual characters replaced."""
    if model_name in ALIASES:
        return model_name
    for alias, spec in ALIASES.items():
        if spec.kind == "hub" and model_name == spec.source:
            return alias
    stem = Path(str(model_name).rstrip("/\\")).name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem) or "model"


def default_stats_path(model_name: str) -> Path:
    """`<cache root>/stats/<model-name>.safetensors` (cache root: `$RETENTION_CACHE_DIR` or the user cache)."""
    return cache_root() / "stats" / f"{stats_name(model_name)}.safetensors"


def model_default_stats_path(model) -> Path | None:
    """The default statistics path of a loaded model, from its `config.name_or_path` (the hub id or
    the folder it was loaded from; for `smollm2-135m` the alias-named cache folder). None for a model
    built in code (no name), which must be given `--stats` explicitly."""
    name = getattr(model.config, "name_or_path", "") or ""
    return default_stats_path(name) if name else None


def load_stats(path: str | Path | None, model) -> QueryStats:
    """Statistics for `model` from `path` (None: the model's default location), checked against it."""
    if path is None:
        path = model_default_stats_path(model)
        if path is None:
            raise RetentionError(
                "this model has no name to find its default calibration statistics by; "
                "pass --stats FILE (written by `retention calibrate --model ... --out FILE`)"
            )
        if not Path(path).is_file():
            # An alias when the model came from one, else the folder or hub id it was loaded from.
            hint = path.stem if path.stem in ALIASES else model.config.name_or_path
            raise RetentionError(
                f"no calibration statistics at {path}; run `retention calibrate --model {hint}` first "
                "(or pass --stats FILE)"
            )
    elif not Path(path).is_file():
        raise RetentionError(
            f"no calibration statistics at {path}; run `retention calibrate --model MODEL --out {path}` first"
        )
    stats = QueryStats.load(path)
    stats.check_model(model, source=f"statistics {path}")
    return stats
