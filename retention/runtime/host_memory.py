"""Large host buffers kept for reuse (glibc only).

glibc's `malloc` serves a block above its mmap threshold (at most 32 MiB, the ceiling of its dynamic
threshold) with a fresh `mmap` and returns it to the kernel on `free`. A CPU decode step allocates
several such blocks and frees them at once: the logits (`[S, V]`: 19 MiB in bf16 at 64 slots of
Qwen2.5's 151,936 tokens), their float32 probabilities (39 MiB), the softmax's temporaries. Each
fresh block is zeroed page by page by the kernel on first touch, every step. Raising the mmap and
trim thresholds keeps such blocks in the heap, where the next step reuses them. Only where blocks
come from changes, never what is computed in them, so a record is the same with and without it
(`tests/retention/test_host_memory.py`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap; freed memory up to it stays in the process.
KEEP_BYTES = 1 << 30

_kept: bool | None = None  # None: not tried yet


def keep_large_blocks() -> bool:
    """Raise glibc's mmap and trim thresholds to `KEEP_BYTES`, once per process; True when they
    were set (False on a C library without `mallopt`: macOS, musl). Costs at most the largest
    freed blocks' memory, which the next decode step allocates again."""
    global _kept
    if _kept is None:
        _kept = False
        if sys.platform.startswith("linux"):
            name = ctypes.util.find_library("c")
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None:
                _kept = bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
    return _kept
