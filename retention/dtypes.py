"""Torch dtypes by name: the three the harness runs in, and what one element costs."""

from __future__ import annotations

import torch

from retention.errors import RetentionError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32" | "bfloat16" | "float16"` (or one of those torch dtypes) -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise RetentionError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """The canonical name (`"bfloat16"`, ...) of a validated dtype."""
    resolved = resolve_dtype(dtype)
    return next(name for name, value in DTYPES.items() if value == resolved)


def dtype_bytes(dtype: str | torch.dtype) -> int:
    """Bytes per element of a run dtype by name, or of any torch dtype (float64 reference tests)."""
    resolved = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    return torch.empty((), dtype=resolved).element_size()
