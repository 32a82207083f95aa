"""A model folder or file identified by content: the files that decide what it computes, hashed.

A copied folder, a symlink to it, or the same folder under another path are one model: the plan names
a model by path to load it, and its cells by this digest (`protocol.plans.cell_identity`). The digest
covers the weights and the configuration (config, generation config, tokenizer), each file by its
sha256 under its name; a file's sha256 is cached by (real path, size, mtime) in
`cache_root()/content-hashes.json`, so a second plan over the same folder reads no weights again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from retention.models.weights_cache import cache_root, sha256_files

# What decides what a folder computes: weights, configuration and tokenizer files.
CONTENT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model", ".tiktoken", ".txt")
# Files a folder may hold that say nothing about the model (this project's own cache marker).
_IGNORED = {"retention-cache.json"}
_CACHE_FILE = "content-hashes.json"


def _cache_path() -> Path:
    return cache_root() / _CACHE_FILE


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def file_sha256(path: Path, cache: dict | None = None) -> str:
    """sha256 of one file, from `cache` when its (real path, size, mtime) is unchanged."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = [st.st_size, st.st_mtime_ns]
    if cache is not None:
        hit = cache.get(real)
        if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
            return hit["sha256"]
    sha = sha256_files([Path(real)])
    if cache is not None:
        cache[real] = {"stamp": stamp, "sha256": sha}
    return sha


def content_sha256(path: str | Path) -> str:
    """The content digest of a model folder (its weights, configuration and tokenizer files, by
    name) or of a single model file (its own sha256)."""
    path = Path(os.path.realpath(path))
    cache = _read_cache()
    if path.is_file():
        digest = file_sha256(path, cache)
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name not in _IGNORED
                       and not p.name.startswith(".") and p.name.endswith(CONTENT_SUFFIXES))
        listing = {p.name: file_sha256(p, cache) for p in files}
        digest = hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()
    try:  # the cache only saves reading; failing to write it changes nothing else
        _cache_path().parent.mkdir(parents=True, exist_ok=True)
        tmp = _cache_path().with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, sort_keys=True))
        os.replace(tmp, _cache_path())
    except OSError:
        pass
    return digest
