"""`retention.models.arch.bench` and `retention bench --layouts` / `--budget-bytes` (tiny shapes; no timing is asserted)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from retention.models.arch import bench
from retention.models.arch.bench import Variant
from retention.models.arch.configs import ArchConfig
from retention.models.arch.model import build_arch, count_parameters
from retention.cli import main

# Two layers, hidden 64, four query heads: one tiny model per family the study compares.
_TINY = dict(layers=2, hidden=64, q_heads=4, vocab=97, ffn=128)
TINY_VARIANTS = {
    "mha": Variant(ArchConfig("kv", kv_heads=4, head_dim=16, **_TINY)),
    "gqa": Variant(ArchConfig("kv", kv_heads=2, head_dim=16, **_TINY)),
    "mqa": Variant(ArchConfig("kv", kv_heads=1, head_dim=16, **_TINY)),
    "mla": Variant(ArchConfig("mla", latent_dim=24, rope_dim=8, nope_dim=16, v_dim=16, **_TINY)),
    "mla-materialised": Variant(ArchConfig("mla", latent_dim=24, rope_dim=8, nope_dim=16, v_dim=16, **_TINY),
                                absorb=False),
}


def test_rows_for_every_layout_and_context_with_measured_bytes():
    rows = bench.step_times(list(TINY_VARIANTS), [16, 32], [2], steps=1, dtype="float32",
                            variants=TINY_VARIANTS, echo=lambda _: None)
    assert [(r["layout"], r["context"], r["batch"]) for r in rows] == [
        (n, c, 2) for n in TINY_VARIANTS for c in (16, 32)]
    for r in rows:
        layout = TINY_VARIANTS[r["layout"]].config.cache_layout().with_dtype("float32")
        # measured from the tensors = the layout's audit figure, per sequence
        assert r["stored_bytes_per_sequence"] == r["audit_bytes_per_sequence"] == layout.bytes_per_token * r["context"]
        assert len(r["step_ms"]) == 1 and r["step_ms_median"] == r["step_ms"][0]
        assert r["absorb"] == (r["layout"] != "mla-materialised")
    per_token = {r["layout"]: r["bytes_per_token"] for r in rows}
    # float32: 2 layers x (K + V) x KV heads x 16; MLA 2 layers x (24 + 8)
    assert per_token == {"mha": 1024, "gqa": 512, "mqa": 256, "mla": 256, "mla-materialised": 256}


def test_absorbed_and_materialised_mla_agree_on_the_prefilled_cache():
    model = build_arch(TINY_VARIANTS["mla"].config)
    torch.manual_seed(0)
    cache = bench.prefilled_cache(model, 24, 2, "cpu")
    absorbed = bench.decode_step(model, cache, 2)
    cache.truncate(24)  # rewind the step's token: the second step overwrites it in place
    model.set_absorb(False)
    materialised = bench.decode_step(model, cache, 2)
    assert absorbed.shape == (2, 1, 97)
    torch.testing.assert_close(absorbed, materialised, rtol=1e-4, atol=1e-5)


def test_study_configs_are_the_124m_shape():
    for cfg in bench.STUDY_124M.values():
        assert (cfg.layers, cfg.hidden, cfg.q_heads, cfg.vocab, cfg.tie_embeddings) == (12, 768, 12, 50_304, True)
        assert 3 * cfg.hidden * cfg.ffn == 2 * cfg.hidden * 3072  # SwiGLU with GPT-2's MLP parameters
    # Tied embeddings + 12 x (attention 4 h^2, SwiGLU 3 h f, two norms) + the final norm: 123.6M, the
    # 124M class (GPT-2 small's 124.4M includes learned position embeddings, which RoPE replaces).
    h = 768
    assert count_parameters(bench.STUDY_124M["mha"]) == 50_304 * h + 12 * (4 * h * h + 3 * h * 2048 + 2 * h) + h
    assert [bench.STUDY_124M[n].kv_heads for n in ("mha", "gqa", "mqa")] == [12, 4, 1]
    mla = bench.STUDY_124M["mla"]
    assert (mla.latent_dim, mla.rope_dim, mla.nope_dim, mla.v_dim) == (256, 16, 64, 64)


def test_cli_layouts_writes_json(tmp_path, monkeypatch):
    for name, v in TINY_VARIANTS.items():  # the CLI's names, on tiny models
        monkeypatch.setitem(bench.VARIANTS, name, v)
    out = tmp_path / "layouts.json"
    res = CliRunner().invoke(main, ["bench", "--layouts", "mqa,mla", "--context", "8,16", "--batch-sizes", "2",
                                    "--steps", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    assert [(r["layout"], r["context"]) for r in fig["rows"]] == [("mqa", 8), ("mqa", 16), ("mla", 8), ("mla", 16)]
    assert fig["steps"] == 1 and fig["batch_sizes"] == [2] and set(fig["configs"]) == {"mqa", "mla"}
    assert "head_dim" not in fig["configs"]["mla"]  # a field MLA does not read is not listed


def test_help_names_every_variant():
    res = CliRunner().invoke(main, ["bench", "--help"])
    assert all(name in res.output for name in bench.VARIANTS)


@pytest.mark.parametrize("args,needle", [
    (["--layouts", "mha,nope"], "nope is not a layout"),
    (["--layouts", "mha", "--budget", "64"], "--budget"),
    (["--layouts", "mha", "--scorer", "full"], "--scorer"),
    (["--steps", "2", "--model", "tiny-random"], "--steps"),
    (["--model", "tiny-random", "--budget-bytes", "4", "--budget", "64"], "not both"),
    (["--model", "tiny-random", "--budget-bytes", "0"], "positive"),
    (["--model", "tiny-random", "--budget-bytes", "inf"], "positive"),
    (["--model", "tiny-random", "--budget-bytes", "0.5"], "holds no token"),
])
def test_bad_input_one_error_line(args, needle):
    res = CliRunner().invoke(main, ["bench", *args])
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert res.exit_code != 0 and len(errors) == 1 and needle in errors[0] and "Traceback" not in res.output, res.output


def test_budget_bytes_converts_through_the_model_layout(tmp_path):
    from retention.models import model_layout

    per_token = model_layout("tiny-random", "float32").bytes_per_token
    out = tmp_path / "bench.json"
    kib = 20.5 * per_token / 1024  # holds 20 whole tokens (floor)
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorer", "full,streaming", "--budget-bytes",
                                    str(kib), "--interval", "8", "--max-new-tokens", "4", "--problems", "0",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    assert fig["budget"] == 20 and fig["budget_kib_requested"] == kib
    assert fig["budget_kib"] == 20 * per_token / 1024
