"""`results/speed-peers/`: the README's vLLM and roofline rows are the JSON files' figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "results" / "speed-peers"
README = (FOLDER / "README.md").read_text() if FOLDER.exists() else ""


@pytest.mark.parametrize("model", ["qwen2.5-coder-1.5b", "smollm2-135m"])
def test_vllm_rows(model):
    fig = json.loads((FOLDER / f"vllm-{model}.json").read_text())
    assert fig["vllm_run"]["version"] == "0.32.0"
    for c in fig["comparison"]:
        ratio = c["hf_tokens_per_second"] / c["vllm_tokens_per_second"]
        assert ratio == pytest.approx(c["ratio_hf_vllm"], rel=1e-9)
        row = (f"| {model} | {c['batch_size']} | {c['hf_tokens_per_second']:.1f} | {c['vllm_tokens_per_second']:.1f} "
               f"| {ratio:.2f} |")
        assert row in README, row


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
@pytest.mark.parametrize("n", [1, 2])
def test_roofline_rows(model, n):
    fig = json.loads((FOLDER / f"roofline-{model}-{n}.json").read_text())
    r = fig["speed"][0]
    assert r["batch_size"] == 64
    achieved = r["step_gflop"] / (r["step_ms_median"] / 1000)
    assert achieved == pytest.approx(r["step_gflops_per_second"], rel=1e-9)
    row = (f"| {model} (run {n}) | {r['step_ms_median']:.1f} ms | {achieved:.1f} GFLOP/s | "
           f"{fig['matmul_peak_gflops']:,.0f} GFLOP/s | {100 * achieved / fig['matmul_peak_gflops']:.1f}% |")
    assert row in README, row
