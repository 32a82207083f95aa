"""The real CPU models, when their parts are installed (`make install-real-models`); skipped otherwise.

The first run converts the GGUF once into the model cache (about a minute for the 0.5B model);
later runs load the cached folder in seconds.
"""

from __future__ import annotations

import importlib.util

import pytest

from retention.models import SPLIT_GGUFS, format_prompt, load_model

pytestmark = pytest.mark.realmodel


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_real_model_loads_with_its_pinned_revision_and_template(alias):
    spec = SPLIT_GGUFS[alias]
    if importlib.util.find_spec(f"{spec.package_prefix}{spec.parts}".replace("-", "_")) is None:
        pytest.skip(f"{alias} parts not installed (make install-real-models)")
    loaded = load_model(alias, dtype="bfloat16")
    assert loaded.revision == spec.sha256 and loaded.prompt == "chat"
    geometry = dict(spec.geometry)
    assert (loaded.geometry.layers, loaded.geometry.q_heads, loaded.geometry.kv_heads) == (
        geometry["num_hidden_layers"], geometry["num_attention_heads"], geometry["num_key_value_heads"])
    text = loaded.tokenizer.decode(format_prompt(loaded.tokenizer, "What is $1+1$?"))
    assert text.startswith("<|im_start|>system\nYou are Qwen") and text.endswith("<|im_start|>assistant\n")
    assert loaded.tokenizer.eos_token == "<|im_end|>"
