"""Latent (MLA) checkpoints through the harness's own cache and `retention run`, and `--budget-bytes`."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from retention.runtime.cache import RetentionCache
from retention.runtime.generate import _cache_kwarg, forward_step
from retention.cli import main
from retention.models.layouts import layout_from_config
from retention.models import build_tiny_tokenizer


def _tiny_deepseek_v2():
    """A seeded random DeepseekV2ForCausalLM (2 layers, latent 24, RoPE key 8) + the byte tokenizer."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = DeepseekV2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=2, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DeepseekV2ForCausalLM(config).eval()
    return model, tokenizer


@pytest.mark.parametrize("which", ["qwen2", "deepseek_v2"])
def test_stored_tensor_bytes_equal_the_layout(which):
    """The meter's bytes (layout x stored tokens) are the bytes the retention cache really holds,
    before and after a compaction; transformers' DeepSeek-V2 caches the latent, not per-head K/V."""
    from retention.models import build_tiny_random

    model = build_tiny_random()[0] if which == "qwen2" else _tiny_deepseek_v2()[0]
    layout = layout_from_config(model.config, torch.float32)
    cache = RetentionCache(model.config.num_hidden_layers)
    n = 30
    with torch.no_grad():
        forward_step(model, torch.arange(n)[None], torch.arange(n)[None], cache, _cache_kwarg(model))

    def held() -> int:
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))

    assert held() == n * layout.bytes_per_token
    g = cache.layers[0].keys.shape[1]
    cache.compact(torch.arange(0, n, 3).expand(1, g, -1))
    assert held() == len(range(0, n, 3)) * layout.bytes_per_token
    if which == "deepseek_v2":
        assert layout.family == "mla" and layout.elements_per_token == 2 * (24 + 8)


def _run(args):
    return CliRunner().invoke(main, ["run", "--quiet", "--limit", "1", "--max-new-tokens", "12", "--ignore-eos",
                                     "--temperature", "0", *args])


@pytest.mark.slow
def test_deepseek_v2_checkpoint_runs_with_latent_eviction(tmp_path):
    model, tokenizer = _tiny_deepseek_v2()
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    res = _run(["--model", str(tmp_path / "m"), "--scorer", "streaming", "--budget-bytes", "4", "--interval", "4",
                "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    (run_dir,) = (tmp_path / "out").iterdir()
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["budget"] == 4 * 1024 // 256 and config["budget_kib"] == 4  # 2 layers x (24 + 8) x 4 bytes
    record = json.loads((run_dir / "records.jsonl").read_text().splitlines()[0])
    assert record["kib_per_token"] == 0.25 and not record["budget_exceeded"]
    assert record["cache_mean_tokens"] * record["kib_per_token"] <= 4


def test_per_head_key_scorers_are_refused_on_a_latent_checkpoint(tmp_path):
    model, tokenizer = _tiny_deepseek_v2()
    (tmp_path / "m").mkdir()
    model.config.to_json_file(tmp_path / "m" / "config.json")  # the layout needs only the config
    res = _run(["--model", str(tmp_path / "m"), "--scorer", "rkv", "--budget", "16", "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and res.output.startswith("Error: rkv cannot score the ")
    assert "(keys, queries missing)" in res.output
    assert res.output.count("\n") == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--budget", "40", "--budget-bytes", "8"], "not both"),
    (["--budget-bytes", "0"], "positive number of KiB"),
    (["--budget-bytes", "0.1"], "holds no token"),
])
def test_budget_bytes_bad_input(args, message, tmp_path):
    res = _run(["--model", "tiny-random", "--scorer", "streaming", *args, "--out", str(tmp_path)])
    assert res.exit_code == 1 and message in res.output and res.output.count("\n") == 1
    assert not any(tmp_path.iterdir())
