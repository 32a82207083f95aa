"""retention.runtime.host_memory: glibc keeps large freed blocks for reuse, and nothing drawn changes."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from retention.runtime.host_memory import keep_large_blocks

GLIBC = sys.platform.startswith("linux") and "libc.so.6" in (ctypes.util.find_library("c") or "")

# Draws of a Qwen2.5-sized step (64 rows of 151,936 logits: 39 MiB of float32 probabilities, above
# glibc's largest dynamic mmap threshold) in a fresh process, with or without the kept blocks.
_DRAW = """
import sys, torch
from retention.runtime.host_memory import keep_large_blocks
from retention.runtime.sampling import SamplingConfig, draw
kept = keep_large_blocks() if sys.argv[1] == "keep" else False
torch.manual_seed(0)
cfg = SamplingConfig(temperature=0.6, top_p=0.95)
gens = [torch.Generator().manual_seed(i) for i in range(64)]
out = []
for step in range(4):
    logits = (torch.randn(64, 151936) * (1 + step)).bfloat16()
    out += draw(logits, cfg, gens)[0].tolist()
print(kept, out)
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_keeping_large_blocks_is_set_once_and_draws_the_same_tokens():
    assert keep_large_blocks() is True and keep_large_blocks() is True
    got = {mode: subprocess.run([sys.executable, "-c", _DRAW, mode], capture_output=True, text=True, timeout=300,
                                check=True).stdout.split(" ", 1)
           for mode in ("keep", "mmap")}
    assert got["keep"][0] == "True" and got["mmap"][0] == "False"
    assert got["keep"][1] == got["mmap"][1] and len(got["keep"][1]) > 64 * 4 * 2
