"""Memory the process can still use on a device (one place for the slot count and the packed weights)."""

from __future__ import annotations

from pathlib import Path

import torch


def available_bytes(device) -> int | None:
    """Memory a run can use now: free GPU memory on CUDA, MemAvailable (/proc/meminfo) on a CPU
    (None where neither can be read)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
