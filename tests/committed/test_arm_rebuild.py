"""Every committed run configuration and plan arm loads, through `validate_arm` as `run` and
`confirm` load them, to the same canonical arm and hash it was recorded with (issue 47: the
kept-set structure moved from a scorer parameter to the routing family; configurations written
with `scorer_params.routing` still load to their own hashes).

The calibration statistics are not committed: the arms stand them in by the sha256 they recorded
(`_resolve_stats`), which is all the configuration holds of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import retention.runs.arms as arms
from protocol.io import config_hash
from protocol.plans import load_plan
from protocol.prereg import ARMS, arm_config
from retention.runs.reproduce import _LOADED_KEYS

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "results").rglob("config.json"))
PLANS = sorted((ROOT / "results").rglob("plan*.json"))
# The hashes the committed plan's arms validated to before issue 47 (computed at c87983b).
PLAN_ARMS = {
    "plan-4e30911dba14.json:qwen2.5-coder-0.5b@b128:baseline": "b26ed01c817a5c23f25e69b83c94329d5e86f5ae23a30efef5e12eeb65e6ff63",
    "plan-4e30911dba14.json:qwen2.5-coder-0.5b@b128:treatment": "a6a37354f678548c8cef9bc550fadcda649e0a650a106d5f243b3a547b95f360",
    "plan-4e30911dba14.json:qwen2.5-coder-0.5b@b256:baseline": "03b5154dacf4b9a0cbb07e1995caeeb65ba5309cbb340b0ec574266cb986076c",
    "plan-4e30911dba14.json:qwen2.5-coder-0.5b@b256:treatment": "cf2f32d34e9dbb853066997dc93f028851e3aa5f486c827ddd94099d6652a7bf",
}


def _stand_in_statistics(monkeypatch, sha256: str | None) -> None:
    monkeypatch.setattr(arms, "_resolve_stats", lambda path, model: (str(path or "stats.safetensors"), sha256))
    monkeypatch.setattr(arms, "check_stats_file", lambda path: None)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_run_configuration_loads_to_its_hash(path, monkeypatch):
    doc = json.loads(path.read_text())
    recorded = doc["config"]
    _stand_in_statistics(monkeypatch, recorded.get("stats_sha256"))
    cfg = {k: v for k, v in recorded.items() if k not in _LOADED_KEYS and k != "nominal_b"}
    if "stats" in (cfg.get("scorer_params") or {}):
        cfg["scorer_params"] = dict(cfg["scorer_params"], stats="stats.safetensors")
    spec = arms.validate_arm(cfg)
    rebuilt = dict(spec.config, **{k: recorded[k] for k in _LOADED_KEYS if k in recorded})
    assert rebuilt == recorded and config_hash(rebuilt) == doc["config_hash"]


def test_committed_plans_load_to_their_hashes(monkeypatch):
    got = {}
    for path in PLANS:
        plan, _ = load_plan(path)
        for cell in plan["cells"]:
            for arm in ARMS:
                cfg = arm_config(plan, "0" * 64, cell, arm)
                _stand_in_statistics(monkeypatch, cfg.get("stats_sha256"))
                got[f"{path.name}:{cell['id']}:{arm}"] = arms.validate_arm(cfg).hash  # every arm loads
    assert {k: got.get(k) for k in PLAN_ARMS} == PLAN_ARMS
