"""`retention bench` writes the figures it measured (no timing is asserted)."""

import json

from click.testing import CliRunner

from retention.cli import main


def test_bench_tiny(tmp_path):
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorers", "full,streaming,random",
                                    "--budget", "24", "--interval", "8", "--accounting", "mean,peak,prefill",
                                    "--new-tokens", "40", "--problems", "2", "--agreement-tokens", "20",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    assert [(r["scorer"], r["accounting"]) for r in fig["speed"]] == [
        (s, a) for s in ("full", "streaming", "random") for a in ("mean", "peak", "prefill")]
    for r in fig["speed"]:
        assert r["tokens_per_second"] > 0 and r["decode_step_ms_median"] > 0
        if r["scorer"] == "full":
            assert r["compactions"] == 0 and r["compaction_ms_median"] is None
            assert r["cache_peak_tokens"] == fig["prompt_tokens"] + 39
        else:
            assert r["compactions"] > 0 and r["compaction_ms_median"] > 0
            if r["accounting"] == "mean":
                assert r["cache_mean_tokens"] <= 24
            if r["accounting"] == "peak":
                assert r["cache_peak_tokens"] <= 24
            if r["accounting"] == "prefill":
                assert r["cache_mean_tokens"] > 24 and r["budget_exceeded"]
    assert [a["scorer"] for a in fig["agreement"]] == ["streaming", "random"]
    for a in fig["agreement"]:
        assert len(a["tokens_before_divergence"]) == 2 and all(0 <= n <= 20 for n in a["tokens_before_divergence"])


def test_bench_unknown_scorer_fails_fast():
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorers", "full,nope"])
    assert res.exit_code != 0 and "unknown scorer" in res.output


def test_bench_batched_lockstep_rows(tmp_path):
    """One row per (variant, accounting, batch size, context); allocated cache per sequence is
    exactly `(b + N)` tokens for an evicting policy and at most twice what is stored for `full`."""
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--scorers", "dynamic-cache,ideal-crop,full,streaming",
                                    "--budget", "24", "--interval", "8", "--new-tokens", "12", "--problems", "0",
                                    "--batch-sizes", "1,3", "--context", "40", "--out", str(out)])
    assert res.exit_code == 0, res.output
    fig = json.loads(out.read_text())
    keys = [(r["variant"], r["batch_size"], r["context"]) for r in fig["speed"]]
    assert keys == [(v, s, 40) for s in (1, 3) for v in ("dynamic-cache", "ideal-crop", "full", "streaming")]
    token_bytes = 4 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32
    for r in fig["speed"]:
        assert r["prompt_tokens"] == 40 and r["steps"] == 11
        assert r["tokens_per_second"] > 0 and r["step_ms_median"] > 0 and 0 <= r["compaction_share"] < 1
        if r["variant"] in ("dynamic-cache", "full"):  # no compaction: the tokens' read, once per step
            assert r["host_syncs_per_step"] == 1.0
        if r["variant"] == "streaming":
            assert r["allocated_bytes_per_sequence"] == (24 - 4 - 1 + 8) * token_bytes
            assert r["cache_mean_tokens"] <= 24
        if r["variant"] == "full":
            assert r["stored_bytes_per_sequence"] <= r["allocated_bytes_per_sequence"] <= 2 * r["stored_bytes_per_sequence"]
        if r["variant"] == "ideal-crop":
            assert r["cache_peak_tokens"] == 25


def test_bench_bad_lists_fail_with_one_line():
    res = CliRunner().invoke(main, ["bench", "--model", "tiny-random", "--batch-sizes", "1,x"])
    assert res.exit_code != 0 and "--batch-sizes" in res.output and "Traceback" not in res.output


def test_bench_prompts_the_model_as_run_does():
    """An R1-style model is benchmarked on its R1 prompt (`retention run`'s), not the chat template."""
    from dataclasses import replace

    from protocol.data import load_problems
    from retention.runs.bench import run_bench
    from retention.models import format_prompt, load_model

    loaded = load_model("tiny-random")
    problems = load_problems()[:1]
    figures = {}
    for style in ("chat", "r1"):
        model = replace(loaded, prompt=style)
        fig = run_bench(model, problems, ["full"], 8, 4, ["mean"], agreement_problems=0)
        figures[style] = fig["prompt_tokens"]
        assert fig["prompt_tokens"] == len(format_prompt(loaded.tokenizer, problems[0].problem, style))
    assert figures["chat"] != figures["r1"]


def test_gpu_bench_graph_safe_step_matches_the_engine_on_cpu(tmp_path):
    """scripts/gpu_bench.py's graph-safe static forward (what it captures as a CUDA graph on a GPU)
    gives the engine's own logits, bit for bit, at every step of a CPU smoke run, compactions and
    the full cache included (a mismatch would turn it off and say so in the row)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "scripts" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    out = tmp_path / "gpu.json"
    assert gpu_bench.main(["--device", "cpu", "--shape", "tiny", "--batch-sizes", "4", "--new-tokens", "40",
                           "--prompt", "490", "--budget", "12", "--out", str(out)]) == 0  # full crosses 512
    rows = json.loads(out.read_text())["rows"]
    assert [r["scorer"] for r in rows] == ["alpha", "full"] and all(r["completed"] for r in rows)
    assert all(r["graphs"].startswith("off (no GPU: the graph-safe forward runs eagerly, checked)") for r in rows)
