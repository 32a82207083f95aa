"""Plugins go through the same reads check as the built-ins: a plugin that reads only positions
runs on every tiny layout model; one that reads per-head keys is refused there with one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retention.models.arch.configs import TINY
from retention.cli import main

OLDEST_FIRST = '''
from dataclasses import dataclass
import torch
from retention.scorers import Scorer

@dataclass
class Older(Scorer):
    """Keeps the oldest tokens: reads only positions (the default `reads`)."""

    def score(self, view):
        return (-view.positions[0].float()).masked_fill(~view.valid[0], float("-inf"))
'''

KEYS = '''
from dataclasses import dataclass
import torch
from retention.scorers import Scorer

@dataclass
class KeyMean(Scorer):
    reads = (frozenset({"keys"}),)

    def score(self, view):
        return torch.stack([k.mean(-1) for k in view.keys]).mean(0).masked_fill(~view.valid[0], float("-inf"))
'''


def _run(tmp_path, model, spec, *extra):
    return CliRunner().invoke(main, ["run", "--model", model, "--scorer", spec, "--budget", "8", "--interval", "2",
                                     "--limit", "1", "--max-new-tokens", "6", "--ignore-eos", "--temperature", "0",
                                     "--no-grade", "--quiet", "--out", str(tmp_path / "out"), *extra])


@pytest.mark.parametrize("model", list(TINY))
def test_a_positions_plugin_runs_on_every_layout_model(tmp_path, model):
    path = tmp_path / "older.py"
    path.write_text(OLDEST_FIRST)
    res = _run(tmp_path, model, f"{path}:Older", "--batch-size", "2")
    assert res.exit_code == 0, res.output
    (run_dir,) = (tmp_path / "out").iterdir()
    (record,) = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    assert record["compactions"] > 0 and record["output_tokens"] == 6 and not record["budget_exceeded"]


def test_a_keys_plugin_is_refused_on_a_shared_store_and_runs_on_transformers(tmp_path):
    path = tmp_path / "keymean.py"
    path.write_text(KEYS)
    res = _run(tmp_path, "tiny-cla", f"{path}:KeyMean")
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert lines[0].startswith(f"Error: {path}:KeyMean cannot score the tiny-cla cache: it reads keys, and this model provides "
                               "attention, positions (keys missing)")
    assert not (tmp_path / "out").exists()
    ok = _run(tmp_path, "tiny-random", f"{path}:KeyMean")
    assert ok.exit_code == 0, ok.output


def test_a_refusal_names_what_is_missing():
    from retention.runtime.engine import TRANSFORMERS_PROVIDES
    from retention.policy.registry import reads_refusal

    line = reads_refusal("x", (frozenset({"positions", "latent"}),), TRANSFORMERS_PROVIDES, "tiny-random")
    assert line == ("x cannot score the tiny-random cache: it reads latent + positions, and this model provides "
                    "calibration, keys, positions, queries, values (latent missing); use full, random, random-pp, "
                    "streaming, h2o, snapkv, rkv, triattention, alpha")
    two = reads_refusal("x", (frozenset({"latent", "calibration"}), frozenset({"keys", "calibration"})),
                        frozenset({"positions", "attention"}), "tiny-cla")
    assert "it reads calibration + latent or calibration + keys" in two and "(calibration, keys missing)" in two
    assert reads_refusal("x", (frozenset({"latent"}), frozenset({"keys"})), TRANSFORMERS_PROVIDES, "m") is None


def test_snapkv_rule_is_recorded_only_when_set():
    from retention.runs.arms import validate_arm
    from retention.errors import RetentionError

    base = {"model": "tiny-random", "scorer": "snapkv", "budget": 16}
    config = validate_arm(base).config
    assert "rule" not in config["scorer_params"]  # configurations from before the rule keep their hash
    config = validate_arm(dict(base, scorer_params={"rule": "head"})).config
    assert config["scorer_params"]["rule"] == "head"
    with pytest.raises(RetentionError, match="snapkv cannot score the tiny-random cache: it reads attention"):
        validate_arm(dict(base, scorer_params={"rule": "group"}))


def test_check_scorer_refuses_what_its_model_does_not_provide(tmp_path):
    """`retention check-scorer` (tiny-random, a transformers model) applies the same reads check."""
    from retention.contract.checks import run_checks

    path = tmp_path / "latent.py"
    path.write_text(KEYS.replace("KeyMean", "LatentMean").replace('{"keys"}', '{"latent"}'))
    (result,) = run_checks(f"{path}:LatentMean", share=False)
    assert result.name == "set-up" and result.ok is False
    assert "cannot score the tiny-random cache: it reads latent, and this model provides calibration, keys, positions, queries, values (latent missing)" in result.detail
