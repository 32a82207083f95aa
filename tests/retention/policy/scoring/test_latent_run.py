"""`retention run --scorer triattention|alpha` on MLA latent caches, end to end through the one
engine (issue 20, item 4): tiny-mla and tiny-qk-norm-mla with `retention calibrate`'s latent
statistics write records with fidelity and evict; an unlimited budget reproduces the full cache's
tokens; a DeepSeek checkpoint folder calibrates and runs the same way."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retention.cli import main

COMMON = ["--quiet", "--limit", "2", "--max-new-tokens", "16", "--ignore-eos", "--temperature", "0", "--fidelity",
          "--no-grade"]


def _calibrate(tmp_path, model: str) -> str:
    text = tmp_path / "calib.txt"
    text.write_text("Solve 3x + 5 = 20: subtract 5, divide by 3, so x = 5. " * 6, encoding="utf-8")
    out = tmp_path / f"{model.replace('/', '_')}.safetensors"
    res = CliRunner().invoke(main, ["calibrate", "--model", model, "--text", str(text), "--tokens", "200",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    return str(out)


def _records(out) -> dict[str, list[dict]]:
    """Scorer (and routing) of each run directory -> its records."""
    runs = {}
    for d in out.iterdir():
        config = json.loads((d / "config.json").read_text())["config"]
        key = config["scorer"] + ("/per-layer" if config["scorer_params"].get("routing") == "per-layer" else "")
        runs[key] = [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines()]
    return runs


@pytest.mark.parametrize(("model", "routing"), [("tiny-mla", "shared"), ("tiny-qk-norm-mla", "per-layer")])
def test_triattention_and_alpha_run_on_a_latent_cache(tmp_path, model, routing):
    stats = _calibrate(tmp_path, model)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--model", model, "--scorer", "triattention,alpha,full", "--stats", stats,
                                    "--routing", routing, "--budget", "12", "--interval", "4", "--out", str(out),
                                    *COMMON])
    assert res.exit_code == 0, res.output
    runs = _records(out)
    suffix = "/per-layer" if routing == "per-layer" else ""
    assert sorted(runs) == sorted(["full", "triattention" + suffix, "alpha" + suffix])
    by_scorer = {k.split("/")[0]: v for k, v in runs.items()}
    for scorer in ("triattention", "alpha"):
        recs = by_scorer[scorer]
        assert len(recs) == 2
        for r in recs:
            assert r["compactions"] > 0 and r["output_tokens"] == 16 and r["cache_peak_tokens"] <= 12 + 4
            assert set(r["fidelity"]) >= {"kl_mean", "kl_max", "top1_agreement"}
        # Eviction changed something the fidelity measures (the scorers are not a no-op).
        assert max(r["fidelity"]["kl_max"] for r in recs) > 0
    assert all(r["compactions"] == 0 for r in by_scorer["full"])


@pytest.mark.parametrize("model", ["tiny-mla", "tiny-qk-norm-mla"])
def test_an_unlimited_budget_reproduces_the_full_cache(tmp_path, model):
    stats = _calibrate(tmp_path, model)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--model", model, "--scorer", "full,triattention,alpha", "--stats", stats,
                                    "--param", "alpha.routing=per-layer", "--budget", "4096", "--out", str(out),
                                    *COMMON])
    assert res.exit_code == 0, res.output
    runs = _records(out)
    assert sorted(runs) == ["alpha/per-layer", "full", "triattention"]
    runs = list(runs.values())
    tokens = [[r["output_token_ids"] for r in recs] for recs in runs]
    assert tokens[0] == tokens[1] == tokens[2]
    assert all(r["fidelity"]["kl_max"] == 0.0 and r["compactions"] == 0 for recs in runs for r in recs)


def test_a_deepseek_checkpoint_calibrates_and_runs_triattention(tmp_path):
    from tests.retention.models.arch.test_run import _tiny_deepseek_v2

    model, tok = _tiny_deepseek_v2()
    model.save_pretrained(tmp_path / "ds")
    tok.save_pretrained(tmp_path / "ds")
    stats = _calibrate(tmp_path, str(tmp_path / "ds"))
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--model", str(tmp_path / "ds"), "--scorer", "triattention,alpha",
                                    "--stats", stats, "--budget", "12", "--interval", "4", "--out", str(out), *COMMON])
    assert res.exit_code == 0, res.output
    for recs in _records(out).values():
        assert all(r["compactions"] > 0 and "kl_mean" in r["fidelity"] for r in recs)
