"""Counting host reads: the calls that bring a tensor's value to the host (on a GPU each one waits
for the device to finish its queued work, so each is a host synchronisation).

`count_host_reads(bucket)` wraps the `torch.Tensor` methods that read a value (`HOST_READS`) while
it is active and counts each call under `bucket()` (a name the caller derives from what is running:
the contract kit counts by scorer hook, the benchmark counts the decode steps). Python-level reads
are what it sees: a read inside a C++ kernel is not a Python call. The engine's own count of its
deliberate reads (`EngineStats.host_syncs`) is held equal to this one by a test.

Timing without a read (`StepClock`) and timing after the device's queued work (`synced_now`).
"""

from __future__ import annotations

import contextlib
import time
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


class StepClock:
    """Step timings without a host synchronisation: CUDA events on a GPU (read once the step's
    tokens are on the host, when they are complete), the wall clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a


def synced_now(device: torch.device) -> float:
    """Wall clock after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
