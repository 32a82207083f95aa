"""Calibration: statistics against direct computations, the file format, geometry checks, the CLI."""

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from retention.policy.scoring.calibration import (QueryStats, calibrate, default_stats_path, load_stats, stats_name, tokens_sha256)
from retention.errors import RetentionError
from retention.policy.registry import make_scorer

SMALL = dict(vocab_size=97, hidden_size=24, intermediate_size=32, num_attention_heads=6, num_key_value_heads=2,
             head_dim=8, max_position_embeddings=256)


def qwen2(layers=2, seed=0, **over):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **{**SMALL, **over})).eval()


def direct_stats(model, ids, q_norm=False):
    """Qm and Qa from the layers' inputs, computed outside the model: input_layernorm -> q_proj
    (-> q_norm), float64 statistics over all tokens."""
    cfg = model.config
    hq, d = cfg.num_attention_heads, cfg.head_dim
    with torch.no_grad():
        hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states  # input of every layer
        qm, qa = [], []
        for l, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(hs[l])
            q = layer.self_attn.q_proj(x).view(-1, hq, d)
            if q_norm:
                q = layer.self_attn.q_norm(q)
            q = q.double()
            qc = torch.complex(q[..., : d // 2], q[..., d // 2:])
            qm.append(qc.mean(0))
            qa.append(qc.abs().mean(0))
    return torch.stack(qm), torch.stack(qa)


def test_known_weights_give_known_statistics():
    """q_proj with zero weights and a known bias: every query is the bias, so Qm = bias bands and
    Qa = their moduli, exactly."""
    model = qwen2()
    bias = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8) / 10 - 2
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.data.zero_()
        layer.self_attn.q_proj.bias.data.copy_(bias.reshape(-1))
    st = calibrate(model, torch.arange(1, 30))
    want = torch.complex(bias[:, :4], bias[:, 4:])
    for l in range(2):
        torch.testing.assert_close(st.qm[l], want)
        torch.testing.assert_close(st.qa[l], want.abs())


def test_statistics_match_direct_computation_across_chunks():
    model = qwen2(layers=3, seed=1)
    ids = torch.randint(0, 97, (50,), generator=torch.Generator().manual_seed(0))
    st = calibrate(model, ids, chunk=16)  # 4 independent sequences: 16 + 16 + 16 + 2
    parts = [direct_stats(model, ids[s:s + 16]) for s in range(0, 50, 16)]
    sizes = [min(16, 50 - s) for s in range(0, 50, 16)]
    qm = sum(p[0] * n for p, n in zip(parts, sizes)) / 50
    qa = sum(p[1] * n for p, n in zip(parts, sizes)) / 50
    torch.testing.assert_close(st.qm, qm.to(torch.complex64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st.qa, qa.float(), rtol=1e-5, atol=1e-6)
    assert st.meta["tokens"] == 50 and st.meta["tokens_sha256"] == tokens_sha256(ids.tolist())
    assert st.meta["geometry"] == {"layers": 3, "q_heads": 6, "kv_heads": 2, "head_dim": 8,
                                   "rope_theta": 10000.0, "rope_scaling": None}


def test_q_norm_models_are_hooked_after_the_norm():
    torch.manual_seed(2)
    cfg = Qwen3Config(num_hidden_layers=2, **SMALL)
    model = Qwen3ForCausalLM(cfg).eval()
    for layer in model.model.layers:  # a non-trivial norm weight, so before/after differ
        layer.self_attn.q_norm.weight.data.uniform_(0.5, 2.0)
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(1))
    st = calibrate(model, ids)
    qm, qa = direct_stats(model, ids, q_norm=True)
    torch.testing.assert_close(st.qm, qm.to(torch.complex64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(st.qa, qa.float(), rtol=1e-5, atol=1e-6)


def test_save_load_roundtrip(tmp_path):
    model = qwen2()
    st = calibrate(model, list(range(1, 40)), model_id="unit/qwen2", text_source="unit test")
    path = st.save(tmp_path / "s.safetensors")
    back = load_stats(path, model)
    assert torch.equal(back.qm, st.qm) and torch.equal(back.qa, st.qa) and torch.equal(back.inv_freq, st.inv_freq)
    assert back.meta == json.loads(json.dumps(st.meta))
    for key in ("model_id", "geometry", "dtype", "tokens", "tokens_sha256", "text_source"):
        assert key in back.meta
    assert back.meta["model_id"] == "unit/qwen2" and back.meta["dtype"] == "float32"


@pytest.mark.parametrize("other,needle", [
    (dict(layers=3), "layers"),
    (dict(num_attention_heads=4, num_key_value_heads=2), "q_heads"),
    (dict(num_key_value_heads=3), "kv_heads"),
    (dict(head_dim=6), "head_dim"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "rope_theta"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope_scaling"),
])
def test_statistics_of_another_geometry_are_refused(tmp_path, other, needle):
    path = calibrate(qwen2(), list(range(1, 20))).save(tmp_path / "s.safetensors")
    layers = other.pop("layers", 2)
    target = qwen2(layers=layers, **other)
    with pytest.raises(RetentionError, match=needle):
        load_stats(path, target)
    sc = make_scorer("triattention", stats=str(path))
    with pytest.raises(RetentionError, match="retention calibrate"):
        with sc.attach(target):
            pass


def test_missing_statistics_say_how_to_make_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path))
    model = qwen2()
    with pytest.raises(RetentionError, match="retention calibrate"):
        load_stats(tmp_path / "nope.safetensors", model)
    with pytest.raises(RetentionError, match="--stats"):  # a model built in code has no name
        load_stats(None, model)
    model.config.name_or_path = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    with pytest.raises(RetentionError, match="retention calibrate --model r1-distill-qwen-7b"):
        with make_scorer("alpha").attach(model):
            pass


def test_default_location(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path))
    assert default_stats_path("smollm2-135m") == tmp_path / "stats" / "smollm2-135m.safetensors"
    assert stats_name("deepseek-ai/DeepSeek-R1-Distill-Llama-8B") == "r1-distill-llama-8b"
    assert stats_name("/some/folder/My Model/") == "My_Model"
    # A model loaded from a folder finds the file its name points to, without --stats.
    model = qwen2()
    model.config.name_or_path = str(tmp_path / "models" / "my-model")
    calibrate(model, list(range(1, 20))).save(default_stats_path("my-model"))
    with make_scorer("triattention").attach(model) as sc:
        assert sc._stats is not None


def test_calibrate_cli(tmp_path, tiny):
    from retention.cli import main

    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox computes 2 + 2 = 4. " * 20, encoding="utf-8")
    out = tmp_path / "tiny.safetensors"
    res = CliRunner().invoke(main, ["calibrate", "--model", "tiny-random", "--text", str(text), "--tokens", "300",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    st = load_stats(out, tiny.model)
    assert st.meta["tokens"] == 300 and st.meta["model_id"] == "tiny-random"
    ids = tiny.tokenizer(text.read_text())["input_ids"][:300]
    assert st.meta["tokens_sha256"] == tokens_sha256(ids)
    direct = calibrate(tiny.model, ids)
    torch.testing.assert_close(st.qm, direct.qm)
    bad = CliRunner().invoke(main, ["calibrate", "--model", "no-such-model", "--text", str(text)])
    assert bad.exit_code != 0 and "unknown model" in bad.output and "Traceback" not in bad.output


def test_default_text_is_the_dev_split_only():
    from protocol.splits import load_split
    from retention.cli.calibrate_cmd import dev_split_text

    text = dev_split_text()
    dev, confirm = load_split("dev"), load_split("confirm")
    assert dev[0].problem.strip() in text and dev[-1].solution.strip() in text
    assert not any(p.problem.strip() in text or p.solution.strip() in text for p in confirm)


def test_load_rejects_a_foreign_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(RetentionError, match="not a retention statistics file"):
        QueryStats.load(tmp_path / "x.safetensors")


def test_calibrate_out_never_overwrites_a_file_that_is_not_statistics(tmp_path):
    from click.testing import CliRunner

    from retention.cli import main

    data = tmp_path / "problems.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    res = CliRunner().invoke(main, ["calibrate", "--model", "tiny-random", "--out", str(data), "--tokens", "256"])
    assert res.exit_code == 1 and "exists and is not a statistics file" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert data.read_text() == '{"problem": "1+1", "answer": "2"}\n'
    stats = tmp_path / "stats.safetensors"
    for _ in range(2):  # a statistics file is recalibrated in place
        res = CliRunner().invoke(main, ["calibrate", "--model", "tiny-random", "--out", str(stats), "--tokens", "256"])
        assert res.exit_code == 0, res.output
