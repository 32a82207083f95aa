"""Cache layouts against the audit's test vectors (../shared/docs/cache-audit.md) and `retention audit`."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.models.layouts import DOCUMENTED, cla, kv, mla, path_concat, path_mla, path_residual

# name, elements per token (whole model), bf16 bytes per token: every row of cache-audit.md.
AUDIT_ROWS = [
    ("mha", 18_432, 36_864),
    ("gqa", 6_144, 12_288),
    ("mqa", 1_536, 3_072),
    ("r1-distill-qwen-7b", 28_672, 57_344),
    ("r1-distill-llama-8b", 65_536, 131_072),
    ("smollm2-135m", 11_520, 23_040),
    ("mla-256-16", 3_264, 6_528),
    ("mla", 1_920, 3_840),
    ("cla", 6_144, 12_288),
    ("path-concat", 6_144, 12_288),
    ("path-residual", 6_144, 12_288),
    ("path-mla", 1_920, 3_840),
    ("path-length-2", 9_216, 18_432),
    ("path-length-8", 5_120, 10_240),
    ("path-length-12", 4_096, 8_192),
    ("path-dim-16", 4_608, 9_216),
    ("path-dim-64", 9_216, 18_432),
]


@pytest.mark.parametrize(("name", "elements", "nbytes"), AUDIT_ROWS)
def test_audit_row(name, elements, nbytes):
    layout = DOCUMENTED[name]
    assert layout.elements_per_token == elements
    assert layout.bytes_per_token == nbytes


def test_r1_rows_in_kib():
    assert DOCUMENTED["r1-distill-qwen-7b"].kib_per_token == 56
    assert DOCUMENTED["r1-distill-llama-8b"].kib_per_token == 128


@pytest.mark.parametrize(("name", "decimal_gb"), [("mha", 38.65), ("gqa", 12.88), ("mqa", 3.22), ("mla-256-16", 6.85)])
def test_128k_context_batch_8(name, decimal_gb):
    assert round(DOCUMENTED[name].cache_bytes(131_072, batch=8) / 1e9, 2) == decimal_gb


def test_mla_is_5_6_times_smaller_than_mha():
    assert round(DOCUMENTED["mha"].bytes_per_token / DOCUMENTED["mla-256-16"].bytes_per_token, 1) == 5.6


@pytest.mark.parametrize("groups", [1, 4, 8])
def test_qk_norm_mla_adds_g_scalars_per_layer(groups):
    plain, normed = mla(12, 256, 16), mla(12, 256, 16, qk_norm_groups=groups)
    assert normed.elements_per_token == plain.elements_per_token + 12 * groups
    assert normed.layer_elements() == [256 + 16 + groups] * 12


def test_formulas_are_the_audits():
    assert DOCUMENTED["path-concat"].formula == "2*4*(3*128+12*32)"
    assert DOCUMENTED["path-residual"].formula == "2*4*(3*160+9*32)"
    assert DOCUMENTED["path-mla"].formula == "3*384+12*(32+32)"
    assert DOCUMENTED["cla"].formula == "2*3*4*256"


def test_sharing_groups():
    assert kv(4, 2, 8).groups() == [(0,), (1,), (2,), (3,)]
    assert cla(12, 4, 4, 256).groups() == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert path_concat(12, 8, 4, 128, 32).groups() == [tuple(range(8)), (8, 9, 10, 11)]
    assert path_residual(6, 3, 2, 16, 4).groups() == [(0, 1, 2), (3, 4, 5)]
    assert path_mla(4, 2, 32, 8, 8).groups() == [(0, 1), (2, 3)]


def test_per_layer_elements_count_a_shared_store_at_its_writer():
    assert cla(12, 4, 4, 256).layer_elements() == [2048, 0, 0, 0] * 3
    assert path_concat(12, 4, 4, 128, 32).layer_elements() == [1024 + 256, 256, 256, 256] * 3
    assert sum(path_residual(12, 4, 4, 160, 32).layer_elements()) == 6_144


def _audit(*args):
    result = CliRunner().invoke(main, ["audit", *args])
    return result


def test_audit_json_lists_every_documented_layout():
    result = _audit("--json")
    assert result.exit_code == 0, result.output
    records = {r["name"]: r for r in json.loads(result.output)}
    assert set(records) == set(DOCUMENTED)
    for name, elements, nbytes in AUDIT_ROWS:
        assert (records[name]["elements_per_token"], records[name]["bytes_per_token"]) == (elements, nbytes)
    assert round(records["mha"]["cache_gb"], 2) == 38.65
    assert records["gqa"]["parameters"] == 98_710_016
    assert "parameters" not in records["mha"]  # the documents give no count for it
    assert records["path-mla"]["parameters"] == records["path-mla"]["parameters_documented"] == 99_694_592
    assert "derived, not stated" in records["path-mla"]["parameters_note"]


def test_audit_text_and_dtype():
    result = _audit("mha", "tiny-mla", "--dtype", "float32", "--context", "1000", "--batch", "1", "--per-layer")
    assert result.exit_code == 0, result.output
    assert "73,728" in result.output  # 18,432 elements x 4 bytes
    assert "per layer: [32, 32, 32, 32]" in result.output


def test_audit_reads_a_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v2", "num_hidden_layers": 12, "num_attention_heads": 8,
                                  "kv_lora_rank": 256, "qk_rope_head_dim": 16}))
    result = _audit(str(config), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["elements_per_token"] == 3_264


@pytest.mark.parametrize("args", [["no-such-layout"], ["--context", "0"]])
def test_audit_bad_input_is_one_line(args, tmp_path):
    result = _audit(*args)
    assert result.exit_code != 0
    assert "Traceback" not in result.output and result.output.strip().count("\n") <= 3


def test_audit_bad_config_file(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    result = _audit(str(bad))
    assert result.exit_code == 1 and result.output.startswith("Error: ") and result.output.count("\n") == 1
