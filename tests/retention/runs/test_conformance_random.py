"""The random control (`random-pp`) against Random Attention's `random_pp` golden vectors.

The cases (retention/data/golden/random/README.md) hold the reference's kept positions at every
eviction event; `retention conformance` checks their structure on the reference's outputs and on
this project's preset. Every rule is shown to fail on a damaged copy or a broken scorer, so a pass
is not vacuous; the preset's configuration is checked to be canonical, and the other scorers' to be
unchanged by the prompt rule's new key.
"""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from retention.cli import main
from retention.errors import RetentionError
from retention.runs.arms import validate_arm
from retention.runs.conformance import check_case, check_dir, load_case, shipped_dir
from retention.runtime.cache import CacheView
from retention.policy.cadence.base import Cadence
from retention.policy.registry import make_scorer
from retention.policy.scoring.random_pp import RandomPP

RANDOM = shipped_dir() / "random"
CASES = sorted(p.stem for p in RANDOM.glob("random_pp_case*.safetensors"))


def test_cases_are_shipped_and_pass():
    assert CASES == ["random_pp_case0", "random_pp_case1", "random_pp_case2"]
    results = {r.name: r for r in check_dir() if r.scorer == "random_pp"}
    assert sorted(results) == CASES
    for r in results.values():
        assert r.ok, r.line()
        assert any(c.startswith("reference:") for c in r.checks) and any(c.startswith("random-pp:") for c in r.checks)
    # Independence is testable where a coincidence is improbable (cases 0 and 2, not the long prompt's).
    assert "random-pp: draws differ between KV heads" in results["random_pp_case0"].checks
    assert "random-pp: draws differ between layers" in results["random_pp_case2"].checks


def test_sidecars_describe_the_files():
    for stem in CASES:
        side, t = load_case(RANDOM / f"{stem}.safetensors")
        p = side["params"]
        assert set(side["tensors"]) == set(t)
        E = p["events"]
        shape = (E, p["layers"], p["batch"], p["kv_heads"])
        assert tuple(t["kept_positions"].shape) == shape + (p["token_budget"],)
        assert tuple(t["positions_before"].shape[:4]) == shape
        assert p["K_selected"] == p["token_budget"] - p["residual_length"]
        assert p["prompt_protected"] == min(p["prompt_len"], p["K_selected"] - 1)
        assert side["reference"]["commit"] == "066c5202f2eeade7b00d377eb48f17ed6fc8cad8"


def _damaged(tmp_path, stem, change_tensors=None, change_params=None):
    side, t = load_case(RANDOM / f"{stem}.safetensors")
    t = {k: v.clone() for k, v in t.items()}
    if change_tensors:
        change_tensors(t)
    if change_params:
        change_params(side["params"])
    save_file(t, str(tmp_path / f"{stem}.safetensors"), metadata={"sidecar": f"{stem}.json"})
    (tmp_path / f"{stem}.json").write_text(json.dumps(side))
    return check_case(tmp_path / f"{stem}.safetensors")


def test_a_reference_that_drops_a_prompt_token_fails(tmp_path):
    def drop(t):  # replace position 0 of one head by a position the cache held but did not keep
        kept, before = t["kept_positions"], t["positions_before"]
        spare = [int(p) for p in before[0, 0, 0, 0] if p >= 0 and p not in kept[0, 0, 0, 0].tolist()][0]
        kept[0, 0, 0, 0, 0] = spare
        t["kept_positions"] = kept.sort(-1).values
    res = _damaged(tmp_path, "random_pp_case0", drop)
    assert not res.ok and any("reference: prompt and window kept" in f for f in res.failures), res.line()
    assert not any(f.startswith("random-pp") for f in res.failures)


def test_a_wrong_prompt_cap_fails(tmp_path):
    res = _damaged(tmp_path, "random_pp_case1", change_params=lambda p: p.update(prompt_protected=40))
    assert not res.ok and "protects 40 prompt tokens" in res.line()


def test_other_event_times_fail(tmp_path):
    res = _damaged(tmp_path, "random_pp_case0", lambda t: t.update(event_next_position=t["event_next_position"] + 1))
    assert not res.ok and any("cadence" in f for f in res.failures), res.line()


def test_draws_shared_by_heads_fail(monkeypatch):
    real = RandomPP.score

    def shared(self, view):
        s = real(self, view)
        return s[:, :, :1].expand_as(s).clone()  # every KV head follows head 0

    monkeypatch.setattr(RandomPP, "score", shared)
    res = check_case(RANDOM / "random_pp_case0.safetensors")
    assert "random-pp: draws differ between KV heads does not hold" in res.failures, res.line()


def test_draws_shared_by_layers_fail(monkeypatch):
    real = RandomPP.score
    monkeypatch.setattr(RandomPP, "score", lambda self, view: real(self, view)[:1].expand(len(view.positions), -1, -1, -1))
    res = check_case(RANDOM / "random_pp_case2.safetensors")
    assert "random-pp: draws differ between layers does not hold" in res.failures, res.line()


def test_an_uncapped_prompt_fails(monkeypatch):
    monkeypatch.setattr(Cadence, "protected_prompt", lambda self, pl, k: pl)
    res = check_case(RANDOM / "random_pp_case1.safetensors")
    assert not res.ok and all(f.startswith("random-pp") for f in res.failures), res.line()


def _view(widths, L=2, G=3, n=None, slots=None):
    n = n or max(widths)
    pos = torch.stack([torch.arange(n).where(torch.arange(n) < w, torch.tensor(-1)) for w in widths])
    pos = pos[:, None].expand(-1, G, -1)
    valid = pos >= 0
    B = len(widths)
    return CacheView([], [], [pos] * L, [torch.zeros_like(valid)] * L, torch.tensor(widths), [valid] * L,
                     torch.zeros(B, dtype=torch.long), torch.tensor(slots or list(range(B))))


def test_scores_are_per_layer_per_head_seeded_and_batch_invariant():
    a = RandomPP()
    a.reset_slot(0, 7)
    alone = a.score(_view([10], slots=[0]))  # [L, 1, G, 10]
    b = RandomPP()
    b.reset_slot(0, 7)
    b.reset_slot(1, 8)
    batched = b.score(_view([10, 16], slots=[0, 1]))  # the same row beside a wider one
    assert alone.shape == (2, 1, 3, 10)
    assert torch.equal(batched[:, 0, :, :10], alone[:, 0]) and bool(torch.isinf(batched[:, 0, :, 10:]).all())
    assert not torch.equal(alone[0], alone[1]) and not torch.equal(alone[:, :, 0], alone[:, :, 1])
    keep = b.select(batched, _view([10, 16], slots=[0, 1]), 6)
    assert keep.shape == (2, 2, 3, 6) and bool((keep[:, 0] < 10).all())


def _arm(**kw):
    return validate_arm(dict({"model": "tiny-random", "budget": 256}, **kw))


def test_the_preset_is_recorded_in_canonical_form():
    cfg = _arm(scorer="random-pp").config
    assert (cfg["interval"], cfg["recent"], cfg["sink"], cfg["protect_prompt_counted"]) == (64, 64, 0, True)
    assert _arm(scorer="random-pp").cadence.prompt_rule == "keep"
    off = _arm(scorer="random-pp", protect_prompt_counted=False).config
    assert off["protect_prompt_counted"] is False
    on_top = _arm(scorer="random-pp", protect_prompt=True)
    assert on_top.cadence.prompt_rule == "keep-on-top" and on_top.config["protect_prompt_counted"] is False


def test_the_rule_is_a_setting_of_every_scorer_and_absent_by_default():
    for scorer in ("random", "streaming", "h2o"):
        plain = _arm(scorer=scorer)
        assert "protect_prompt_counted" not in plain.config  # the hash of earlier runs holds
        assert plain.config == _arm(scorer=scorer, protect_prompt_counted=False).config
        kept = _arm(scorer=scorer, protect_prompt_counted=True)
        assert kept.cadence.prompt_rule == "keep" and kept.config["protect_prompt_counted"] is True
    with pytest.raises(RetentionError, match="not both"):
        _arm(scorer="random", protect_prompt=True, protect_prompt_counted=True)
    with pytest.raises(RetentionError, match="true or false"):
        _arm(scorer="random", protect_prompt_counted="yes")


def test_counted_prompt_is_capped_inside_b():
    c = Cadence(budget=100, interval=10, accounting="prefill", recent=8, prompt_counted=True)
    assert (c.protected_prompt(30, 100), c.protected_prompt(300, 100), c.keep(300)) == (30, 91, 100)
    top = Cadence(budget=100, interval=10, accounting="prefill", recent=8, protect_prompt=True)
    assert (top.protected_prompt(300, 100), top.keep(300)) == (300, 400)
    assert Cadence(budget=100, interval=10).protected_prompt(30, 100) == 0
    assert make_scorer("random-pp").default_prompt == "keep"


def test_the_cli_rule_reaches_every_listed_arm(tmp_path):
    res = CliRunner().invoke(main, ["run", "--model", "tiny-random", "--scorer", "random", "--budget", "64",
                                    "--protect-prompt", "--prompt-rule", "keep", "--limit", "1", "--out", str(tmp_path)])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "--prompt-rule keep" in res.output
    res = CliRunner().invoke(main, ["run", "--model", "tiny-random", "--scorer", "random,random-pp", "--budget", "128",
                                    "--prompt-rule", "keep", "--limit", "1", "--max-new-tokens", "2", "--quiet",
                                    "--out", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    configs = [json.loads(p.read_text())["config"] for p in sorted((tmp_path / "runs").glob("*/config.json"))]
    assert sorted(c["scorer"] for c in configs) == ["random", "random-pp"]
    assert all(c["protect_prompt_counted"] is True and c["protect_prompt"] is False for c in configs)
