"""A record's cache trace (`trace.jsonl` key `cache`, schema v1, docs/records.md) as viewer data.

The trace stores, per compaction, the kept positions of every (eviction group, KV head) as a base64
bitset over `0..n_positions-1`. The viewer draws one position x step map per record, so this module
folds the G*H bitsets of a compaction into one count per position (how many (group, head) pairs hold
it) and keeps only the positions some pair holds, delta-encoded: small JSON for a sparse cache.

Reconstruction (done in the browser, `static/viewer.js`, from these counts): at decode step `d`
(0-based; step d feeds output token d at position P + d) after the last compaction `c` with
`c.step <= d`, a pair holds its kept set plus every position from `P + c.step` to `P + d` (the
tokens generated since); before the first compaction, every position up to `P + d`. The mean over
pairs of the held count, averaged over the meter's decode steps, is the record's `cache_mean_tokens`.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from protocol.errors import ProtocolError

SCHEMA_VERSION = 1


def unpack_bits(b64: str, n: int) -> np.ndarray:
    """(n,) bool array of a base64 packed bitset (numpy packbits, bitorder little: bit i = position i)."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ProtocolError("cache trace: a positions bitset is not base64") from None
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")
    if bits.size < n:
        raise ProtocolError(f"cache trace: a bitset holds {bits.size} positions, expected {n}")
    return bits[:n].astype(bool)


def _pair_counts(sets, n: int, pairs: int) -> np.ndarray:
    """(n,) int: how many of the G*H bitsets `sets` ([[b64 ...H] ...G]) hold each position."""
    flat = [b for group in sets for b in group]
    if len(flat) != pairs:
        raise ProtocolError(f"cache trace: {len(flat)} bitsets in a compaction, expected groups x kv_heads = {pairs}")
    return np.sum([unpack_bits(b, n) for b in flat], axis=0, dtype=np.int64)


def sparse(counts: np.ndarray, full: int) -> dict:
    """{"p": delta-encoded positions with a count > 0, "c": their counts, or absent when all equal `full`}."""
    pos = np.flatnonzero(counts)
    out = {"p": np.diff(pos, prepend=0).tolist()}
    vals = counts[pos]
    if vals.size and not np.all(vals == full):
        out["c"] = vals.tolist()
    return out


def _int(cache: dict, key: str) -> int:
    value = cache.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"cache trace: {key!r} must be a non-negative integer, got {value!r}")
    return value


def cache_map(cache: dict) -> dict:
    """The viewer's map data of one record's `cache` trace object.

    Returns {"P": prompt tokens, "n": positions, "pairs": G*H, "steps": decode steps, "prefill":
    stored after prefill, "c": [{"s": step, "b": before, "k": kept per pair (list, G*H), "held":
    sparse counts, "m"/"q": sparse counts of merged / quantised positions, "a": allocation}]}.
    """
    if not isinstance(cache, dict) or cache.get("version") != SCHEMA_VERSION:
        raise ProtocolError(f"cache trace: version {cache.get('version') if isinstance(cache, dict) else None!r} "
                            f"is not {SCHEMA_VERSION}")
    prompt, n = _int(cache, "prompt_tokens"), _int(cache, "n_positions")
    pairs = _int(cache, "groups") * _int(cache, "kv_heads")
    out = {"P": prompt, "n": n, "pairs": pairs, "steps": _int(cache, "steps"),
           "prefill": _int(cache, "prefill_stored"), "c": []}
    for comp in cache.get("compactions") or []:
        kept = [int(k) for group in comp["kept"] for k in group]
        held = _pair_counts(comp["positions"], n, pairs)
        if held.sum() != sum(kept):
            raise ProtocolError(f"cache trace: compaction at step {comp.get('step')} keeps {sum(kept)} tokens "
                                f"but its bitsets hold {int(held.sum())}")
        entry = {"s": int(comp["step"]), "b": int(comp["before"]), "k": kept, "held": sparse(held, pairs)}
        for key, short in (("merged", "m"), ("quantised", "q")):
            if comp.get(key) is not None:
                entry[short] = sparse(_pair_counts(comp[key], n, pairs), pairs)
        if comp.get("allocation") is not None:
            entry["a"] = [int(a) for group in comp["allocation"] for a in group]
        out["c"].append(entry)
    return out
