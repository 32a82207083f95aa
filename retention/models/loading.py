"""Loading: dtype/device validation, `load_model`, and where each model came from (`LoadedModel`)."""

from __future__ import annotations

import functools
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from transformers.utils import logging as hf_logging

from retention.dtypes import dtype_name, resolve_dtype
from retention.errors import RetentionError
from retention.memory import available_bytes
from retention.models.aliases import SPLIT_GGUFS, TINY_RANDOM_SEED, ModelRef, resolve_model
from retention.models.arch.configs import TINY
from retention.models.arch.model import build_arch, is_arch_model
from retention.models.gguf import cached_quant, gguf_config, gguf_file_cache, gguf_quant, split_gguf_cache
from retention.models.hub import PROBE_SECONDS, hub_answers
from retention.models.layouts import DOCUMENTED, CacheLayout, layout_from_config
from retention.runtime.packing import pack_linears, packing_supported
from retention.models.prompts import prompt_style
from retention.models.tiny import build_tiny_random, build_tiny_tokenizer
from retention.models.weights_cache import _smollm2_cache, sha256_files, smollm2_gguf_path

PACK_SHARE = 0.25  # of the memory available after loading, at most, for packed weight copies
_DEVICE_RE = re.compile(r"cpu|mps|cuda(?::(\d+))?")


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


@dataclass
class LoadedModel:
    """A model ready to decode, with where it came from.

    `model` is in eval mode with `attn_implementation="sdpa"`; `name` is the alias or path as
    given; `model_id` the hub id, GGUF file or resolved folder; `revision` the hub commit when
    known, else the sha256 of the weights file(s) (of the GGUF file for a GGUF model), or
    `random-seed-<n>` for `tiny-random`; `prompt` its prompt style (`retention.models.prompts`).
    """

    model: Any
    tokenizer: Any
    name: str
    model_id: str
    revision: str
    dtype: str
    device: str
    geometry: CacheLayout
    load_seconds: float = field(default=0.0, compare=False)
    prompt: str = "chat"
    # The quantisation type of the GGUF file the weights were dequantised from (None: not a GGUF model).
    quant: str | None = None

    def metadata(self) -> dict[str, Any]:
        """JSON-ready provenance for run records (no tensors)."""
        return {
            "name": self.name,
            "model_id": self.model_id,
            "revision": self.revision,
            "dtype": self.dtype,
            "device": self.device,
            "geometry": self.geometry.as_dict(),
            "prompt": self.prompt,
        }

    @property
    def layout(self) -> CacheLayout:
        """The model's cache layout (the same object as `geometry`, its former name)."""
        return self.geometry


def load_model(
    name: str,
    dtype: str = "float32",
    device: str = "cpu",
    revision: str | None = None,
    *,
    seed: int = TINY_RANDOM_SEED,
    pack: bool | None = None,
) -> LoadedModel:
    """Load `name` (an alias of `ALIASES`, an aliased hub id, a local folder with config.json, or a
    local `.gguf` file, converted once into the cache).

    `dtype` is `float32 | bfloat16 | float16`; `device` is `cpu | cuda | cuda:N | mps` and must be
    available. `revision` (a hub branch, tag or commit) applies to hub models only. `seed` selects
    the weights of `tiny-random` and is ignored otherwise. `pack` reorders bfloat16 CPU linear
    weights once for oneDNN (`retention.runtime.packing`: the same outputs, faster steps), within
    `PACK_SHARE` of the memory available after loading; None: unless `RETENTION_PACK=0` is set
    (every command, for measuring what packing buys). Every failure a user can cause or fix
    ends in a one-line `RetentionError`.
    """
    torch_dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    ref = resolve_model(name)
    if revision is not None and ref.kind != "hub":
        raise RetentionError(f"a revision applies to hub models only, not to {name!r}")

    # transformers draws a per-tensor "Loading weights" bar; the run's own progress bar is enough.
    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    quant = None
    if ref.kind == "random":
        model, tokenizer = build_tiny_random(seed)
        model = model.to(device=device, dtype=torch_dtype)
        model_id, resolved_revision = "tiny-random", f"random-seed-{seed}"
    elif ref.kind == "arch":
        model, tokenizer = build_arch(ref.source, seed, torch_dtype).to(device), build_tiny_tokenizer()
        model_id, resolved_revision = ref.source, f"random-seed-{seed}"
    elif ref.kind == "gguf":
        gguf = smollm2_gguf_path()
        folder, sha = _smollm2_cache(gguf)
        model, tokenizer = _load_pretrained(str(folder), torch_dtype, device, local_files_only=True)
        model_id, resolved_revision = str(gguf), sha
        quant = _gguf_quant(ref, folder, gguf)
    elif ref.kind in ("parts", "gguf-file"):
        folder, sha = _gguf_cache(ref)
        model, tokenizer = _load_pretrained(str(folder), torch_dtype, device, local_files_only=True)
        model_id, resolved_revision = _gguf_model_id(ref), sha
        quant = _gguf_quant(ref, folder, None if ref.kind == "parts" else Path(ref.source))
    elif ref.kind == "hub":
        model, tokenizer = _load_from_hub(ref.source, torch_dtype, device, revision)
        model_id, resolved_revision = ref.source, _hub_commit(ref.source, revision)
    else:
        model, tokenizer = _load_pretrained(ref.source, torch_dtype, device, local_files_only=True)
        model_id, resolved_revision = ref.source, _folder_revision(Path(ref.source))

    model.eval()
    if pack is None:
        pack = os.environ.get("RETENTION_PACK", "1") != "0"
    if pack and packing_supported(torch_dtype, device):
        pack_linears(model, int(PACK_SHARE * (available_bytes(device) or 0)))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=ref.name,
        model_id=model_id,
        revision=resolved_revision,
        dtype=dtype_name(torch_dtype),
        device=device,
        geometry=_layout_of(model, torch_dtype),
        load_seconds=time.perf_counter() - start,
        prompt=prompt_style(ref.name, tokenizer),
        quant=quant,
    )


def _gguf_quant(ref: ModelRef, folder: Path, gguf: Path | None) -> str | None:
    """The quantisation type of a GGUF model: from its file's header when the file is at hand, else
    (split parts, assembled only to convert) what the conversion recorded or the alias pins."""
    if gguf is not None:
        return gguf_quant(gguf)
    return cached_quant(folder) or SPLIT_GGUFS[ref.source].quant


def _gguf_cache(ref: ModelRef) -> tuple[Path, str]:
    """The converted cache folder of a split or local GGUF model and the GGUF's sha256."""
    if ref.kind == "parts":
        return split_gguf_cache(SPLIT_GGUFS[ref.source])
    return gguf_file_cache(Path(ref.source))


def _gguf_model_id(ref: ModelRef) -> str:
    """Where a GGUF model came from: its packages (split) or its file path."""
    if ref.kind == "parts":
        spec = SPLIT_GGUFS[ref.source]
        return f"{spec.package_prefix}1..{spec.parts}=={spec.version}"
    return ref.source


def _layout_of(model, torch_dtype: torch.dtype) -> CacheLayout:
    """A reference layout model knows its layout; a transformers model's follows from its config."""
    if is_arch_model(model):
        return model.config.cache_layout().with_dtype(torch_dtype)
    return layout_from_config(model.config, torch_dtype)


def _load_pretrained(
    path_or_id: str,
    torch_dtype: torch.dtype,
    device: str,
    *,
    revision: str | None = None,
    local_files_only: bool = False,
) -> tuple[Any, Any]:
    """`AutoTokenizer` + `AutoModelForCausalLM.from_pretrained` with SDPA attention, onto `device`."""
    # deferred: transformers' Auto classes add ~0.3 s to CLI start-up (the CLI imports this module)
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
    if not hub_answers():
        raise RetentionError(
            f"cannot load {hub_id}: it is not in the hub cache and the hub does not answer (probed for "
            f"{PROBE_SECONDS:g} s; now HF_HUB_OFFLINE); download it where there is network (e.g. `hf download "
            f"{hub_id}`) or pass a local folder as --model")
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


def weights_reference(name: str) -> tuple[str, str, str]:
    """(folder or hub id an external engine loads, model_id, revision) of model `name`, named as
    `load_model` names them, so that another engine's run configuration matches this one's."""
    ref = resolve_model(name)
    if ref.kind in ("random", "arch"):
        raise RetentionError(f"{name} is built in code; an external engine loads a model folder or a hub id")
    if ref.kind == "gguf":
        gguf = smollm2_gguf_path()
        folder, sha = _smollm2_cache(gguf)  # the dequantised safetensors folder
        return str(folder), str(gguf), sha
    if ref.kind in ("parts", "gguf-file"):
        folder, sha = _gguf_cache(ref)
        return str(folder), _gguf_model_id(ref), sha
    if ref.kind == "hub":
        return ref.source, ref.source, _hub_commit(ref.source, None)
    return ref.source, ref.source, _folder_revision(Path(ref.source))


@functools.cache
def _tiny_random_layout() -> CacheLayout:
    """The layout of `tiny-random` (its config is fixed): built once per process, not once per arm."""
    return layout_from_config(build_tiny_random()[0].config, "float32")


def model_layout(name: str, dtype: str | torch.dtype = "bfloat16") -> CacheLayout:
    """The cache layout of model `name` without loading its weights: from the folder's config.json,
    the documented layout of an aliased model, a GGUF header, or the config of `tiny-random`."""
    ref = resolve_model(name)
    if ref.kind == "local":
        try:
            config = json.loads((Path(ref.source) / "config.json").read_text())
        except ValueError as exc:
            raise RetentionError(f"{name}: config.json is not valid JSON ({exc})") from None
        return layout_from_config(config, dtype)
    if ref.kind == "random":
        return _tiny_random_layout().with_dtype(dtype)
    if ref.kind == "parts":
        return layout_from_config(dict(SPLIT_GGUFS[ref.source].geometry), dtype)
    if ref.kind == "gguf-file":
        return layout_from_config(gguf_config(Path(ref.source)), dtype)
    if ref.kind == "arch":
        return TINY[ref.source].cache_layout().with_dtype(dtype)
    return DOCUMENTED[ref.name].with_dtype(dtype)
