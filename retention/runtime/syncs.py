"""Counting host reads: the calls that bring a tensor's value to the host (on a GPU each one waits
for the device to finish its queued work, so each is a host synchronisation).

`count_host_reads(bucket)` wraps the `torch.Tensor` methods that read a value (`HOST_READS`) while
it is active and counts each call under `bucket()` (a name the caller derives from what is running:
the contract kit counts by scorer hook, the benchmark counts the decode steps). Python-level reads
are what it sees: a read inside a C++ kernel is not a Python call. The engine's own count of its
deliberate reads (`EngineStats.host_syncs`) is held equal to this one by a test.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

import torch

# Tensor methods that read a device value on the host (on a GPU each waits for the device).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads(bucket: Callable[[], str] = lambda: "all") -> Iterator[Counter]:
    """Count calls of `HOST_READS` while active, by `bucket()` at the time of each call."""
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(fn):
        def counted(self, *a, **kw):
            counts[bucket()] += 1
            return fn(self, *a, **kw)
        return counted

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
