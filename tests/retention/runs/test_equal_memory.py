"""`retention bench --memory-budget MIB` (issue 48, item 1): every engine arm gets the slots its
measured peak cache fits in the same KV memory and decodes the same sequences (no timing asserted)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.runs.equal_memory import MemoryArm, plan_arms, slots_at_memory

# tiny-random in float32: 4 layers x (K, V) x 2 KV heads x head dim 16 x 4 bytes = 1 KiB per token.
TINY_KIB_PER_TOKEN = 4 * 2 * 2 * 16 * 4 / 1024


def test_slots_at_memory_is_the_floor():
    assert slots_at_memory(1.0, 1024.0, 99) == (1, False)
    assert slots_at_memory(1.0, 1024.5, 99) == (0, False)
    assert slots_at_memory(1.0, 100.0, 99) == (10, False)  # 1024 / 100 = 10.24
    assert slots_at_memory(64.0, 1.0, 256) == (256, True)
    assert slots_at_memory(0.3, 0.1 * 1024, 99) == (3, False)  # 0.3 / 0.1 in floats is 2.9999999999999996
    with pytest.raises(ValueError):
        slots_at_memory(1.0, 0.0, 9)


def test_plan_arms_skips_reference_variants_and_repeats():
    rows = [{"variant": "dynamic-cache", "accounting": None, "cache_peak_kib": 10.0},
            {"variant": "full", "accounting": "mean", "cache_peak_kib": 300.0},
            {"variant": "streaming", "accounting": "mean", "cache_peak_kib": 40.0},
            {"variant": "streaming", "accounting": "mean", "cache_peak_kib": 40.0}]
    assert plan_arms(rows, 1.0, 16) == [MemoryArm("full", "mean", 300.0, 3, False),
                                       MemoryArm("streaming", "mean", 40.0, 16, True)]


def test_bench_equal_memory_tiny(tmp_path):
    out = tmp_path / "bench.json"
    mib = 0.2
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorers", "dynamic-cache,full,streaming",
                                    "--budget", "24", "--interval", "8", "--new-tokens", "12", "--problems", "0",
                                    "--batch-sizes", "2", "--context", "40", "--memory-budget", str(mib),
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    same = {r["variant"]: r for r in fig["speed"]}
    mem = {r["variant"]: r for r in fig["equal_memory"]}
    assert sorted(mem) == ["full", "streaming"]  # the engine's arms only
    assert same["full"]["cache_peak_tokens"] == 40 + 11
    for v, r in mem.items():
        peak_kib = same[v]["cache_peak_tokens"] * TINY_KIB_PER_TOKEN
        assert r["peak_kib_per_sequence"] == pytest.approx(peak_kib, rel=1e-12)
        assert r["slots"] == math.floor(mib * 1024 / peak_kib)
    assert mem["full"]["slots"] == 4 and mem["streaming"]["slots"] > mem["full"]["slots"]
    Q = max(r["slots"] for r in mem.values())
    for r in mem.values():
        assert r["sequences"] == Q and r["tokens"] == Q * 12 and r["tokens_per_second"] > 0
        assert r["context"] == 40
    assert mem["full"]["vs_full"] == 1.0
    assert "equal memory: 0.2 MiB" in res.output and "streaming/mean" in res.output


def test_memory_options_need_the_budget():
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--memory-sequences", "4"])
    assert res.exit_code != 0 and "--memory-sequences" in res.output and "only with --memory-budget" in res.output
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--memory-budget", "0"])
    assert res.exit_code != 0 and "--memory-budget" in res.output


def test_quant_variant_gets_slots_from_its_packed_bytes(tmp_path):
    """`streaming+quant`: the packed store's metered peak KiB (codes, grids and the full-precision ring,
    from the tensors) is below the same budget in full precision, so the memory holds more of its slots;
    every arm decodes the same sequences and its decode-only tok/s is reported."""
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorers", "full,streaming,streaming+quant",
                                    "--budget", "96", "--interval", "16", "--new-tokens", "40", "--problems", "0",
                                    "--batch-sizes", "2", "--context", "120", "--memory-budget", "1",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    mem = {r["variant"]: r for r in json.loads(out.read_text())["equal_memory"]}
    same = {r["variant"]: r for r in json.loads(out.read_text())["speed"]}
    assert same["streaming+quant"]["cache_peak_tokens"] == same["streaming"]["cache_peak_tokens"]
    assert mem["streaming+quant"]["peak_kib_per_sequence"] < mem["streaming"]["peak_kib_per_sequence"]
    assert mem["streaming+quant"]["slots"] > mem["streaming"]["slots"] > mem["full"]["slots"]
    for r in mem.values():
        assert r["tokens"] == r["sequences"] * 40 and r["decode_tokens_per_second"] > 0
    assert "streaming+quant/mean" in res.output
    bad = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorers", "streaming+nosuch"])
    assert bad.exit_code != 0 and "nosuch" in bad.output
