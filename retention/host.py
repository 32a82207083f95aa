"""The host a record was made on: CPU, instruction sets, kernel libraries, threads.

bfloat16 kernels differ across instruction sets (AVX2, AVX512, AVX512-BF16, AMX): the same
configuration decoded on two CPUs can give different tokens. So every record carries
`host_fingerprint()`, and `retention reproduce` compares it with the host it runs on
(`host_differences`) to say when tokens cannot be expected to match (docs/reproducibility.md).

The ISA-independent mode (`retention run --isa-portable`) is float32 with every kernel library
held to the AVX2 code paths (`PORTABLE_ENV`); the variables are read when the libraries load,
so they must be set before the process starts (`portable_problem` says which are missing).
"""

from __future__ import annotations

import functools
import os
import platform
import re

import torch
import transformers

__all__ = ["host_fingerprint", "host_differences", "PORTABLE_ENV", "portable_problem", "ISA_FLAGS",
           "TOKEN_KEYS"]

#: CPU flags that change which kernels run (vector width, bf16/fp16 dot products, AMX tiles).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
#: The ISA-independent mode: ATen's own kernels, oneDNN and MKL all held to AVX2 code paths.
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_CBWR": "AVX2,STRICT"}
#: Fingerprint keys on which the tokens of a record depend (the rest is provenance).
TOKEN_KEYS = ("isa", "torch", "onednn", "mkl", "threads", "env", "machine")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; (platform.processor(), []) elsewhere."""
    model, flags = platform.processor() or platform.machine(), ()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not flags:
                    model = value.strip()
                elif key == "flags":
                    flags = tuple(value.split())
                    break
    except OSError:
        pass
    return model, flags


@functools.lru_cache(maxsize=None)
def _library(pattern: str) -> str | None:
    m = re.search(pattern, torch.__config__.show())
    return m.group(1) if m else None


def host_fingerprint() -> dict:
    """What a record's tokens may depend on besides its configuration: `cpu` model, `isa` flags
    present (of `ISA_FLAGS`), `machine`, the torch / oneDNN / MKL / transformers versions, torch's
    `threads`, ATen's `capability` and the ISA `env` variables set (`PORTABLE_ENV`'s names)."""
    model, flags = _cpuinfo()
    present = set(flags)
    return {
        "cpu": model,
        "machine": platform.machine(),
        "isa": [f for f in ISA_FLAGS if f in present],
        "torch": torch.__version__,
        "onednn": _library(r"MKL-DNN v([0-9.]+)"),
        "mkl": _library(r"Math Kernel Library Version ([0-9.]+)"),
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: os.environ[k] for k in PORTABLE_ENV if k in os.environ},
    }


def host_differences(recorded: dict | None, current: dict) -> list[str]:
    """The fingerprint keys on which tokens depend that differ (`recorded` None: unknown host,
    a record written before fingerprints: ["host"])."""
    if not isinstance(recorded, dict):
        return ["host"]
    return [k for k in (*TOKEN_KEYS, "capability") if recorded.get(k) != current.get(k)]


def portable_problem(dtype: str) -> str | None:
    """Why the ISA-independent mode cannot run here, or None when it can: it needs float32 and
    `PORTABLE_ENV` set before the process started."""
    if dtype != "float32":
        return f"--isa-portable needs --dtype float32 (bfloat16 kernels differ by instruction set), got {dtype}"
    missing = [f"{k}={v}" for k, v in PORTABLE_ENV.items() if os.environ.get(k) != v]
    if missing:
        return ("--isa-portable needs the kernel libraries held to AVX2 before the process starts: "
                "set " + " ".join(missing))
    return None
