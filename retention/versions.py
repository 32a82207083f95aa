"""The versions a record or a benchmark notes as its provenance (this package, torch, transformers,
Python): one small module at the bottom, so that runs, benchmarks and the layout bench share it."""

from __future__ import annotations

import platform

import torch
import transformers

from retention import __version__


def library_versions() -> dict:
    """`{"retention", "torch", "transformers", "python"}` version strings of this process."""
    return {
        "retention": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
