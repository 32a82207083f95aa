"""Reference layout models through `retention run` (retention.arch.generate): exactness at an
unlimited budget, meter bytes equal to the stored tensors, kept sets per sharing group, the prompt
rule, sampling seeds, and the CLI path with its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from retention.arch.configs import TINY
from retention.arch.generate import generate_one
from retention.arch.model import build_arch
from retention.arch.retention import SCORERS
from retention.cadence import Cadence
from retention.cli import main
from retention.engine import Request, SamplingConfig
from retention.errors import RetentionError
from retention.models import ALIASES, load_model

PROMPT = [int(t) for t in torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))]
GREEDY = SamplingConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
FAST = {"tiny-kv", "tiny-mla", "tiny-path-residual"}  # the others are marked slow (`-m "not slow"` skips them)


def _layouts():
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in TINY]


def _generate(model, scorer, cadence, sampling=GREEDY, seed=0, **kw):
    kib = model.new_cache().layout.kib_per_token
    return generate_one(model, Request("p", PROMPT, seed), scorer, {}, cadence, sampling, set(), kib, **kw)


def _naive_greedy(model, n: int) -> list[int]:
    """Greedy tokens from a fresh forward over the whole sequence at every step (no decode cache)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache()).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(PROMPT):]


def test_every_reference_layout_has_a_model_alias():
    assert {n for n, a in ALIASES.items() if a.kind == "arch"} == set(TINY)
    loaded = load_model("tiny-path-concat")
    assert loaded.geometry == TINY["tiny-path-concat"].cache_layout().with_dtype(torch.float32)
    assert loaded.revision == "random-seed-0"


@pytest.mark.parametrize("name", _layouts())
def test_unlimited_budget_is_the_full_cache_decode(name):
    """Every evicting scorer at a budget above the sequence equals a cache-free greedy decode, and
    its fidelity against the full cache is exact (float64)."""
    model = build_arch(name, dtype=torch.float64)
    expected = _naive_greedy(model, GREEDY.max_new_tokens)
    for scorer in SCORERS:
        cadence = Cadence(budget=None if scorer == "full" else 200, interval=1, sink=1)
        g = _generate(model, scorer, cadence, fidelity=True)
        assert g.token_ids == expected, scorer
        assert max(g.fidelity.kl) == 0.0 and all(g.fidelity.top1_agree)


@pytest.mark.parametrize("name", _layouts())
@pytest.mark.parametrize("scorer", ["streaming", "h2o", "snapkv", "random"])
def test_meter_bytes_are_the_stored_tensors_and_groups_stay_consistent(name, scorer):
    model = build_arch(name)
    layout = model.new_cache().layout
    cadence = Cadence(budget=16, interval=4, sink=2, recent=8 if scorer == "snapkv" else 0)
    seen = []

    def check(cache, meter):
        stored = cache.stored_lengths()
        assert len(set(stored)) == 1  # every sharing group compacts to the same count
        assert cache.nbytes() == stored[0] * layout.bytes_per_token == meter.final * layout.bytes_per_token
        for s in layout.stores:  # a store holds exactly its sharing group's tokens
            assert cache.tensors[s.name].shape[2] == cache.positions[cache.group_of_store[s.name]].shape[-1]
        for g, members in enumerate(cache.groups):
            assert all(cache.layer_positions(m) is cache.positions[g] for m in members)
        if meter.steps:  # decoding: buffers of b + N tokens, written in place, never grown
            assert cache.allocated_bytes() == (cadence.nominal + cadence.interval) * layout.bytes_per_token
        seen.append(stored[0])

    g = _generate(model, scorer, cadence, on_step=check)
    assert g.meter.compactions > 0 and max(seen) <= cadence.nominal + cadence.interval - 1  # after compaction
    assert g.meter.mean <= 16 and not g.meter.exceeded and g.meter.peak <= 16 + 4
    assert g.meter.steps == GREEDY.max_new_tokens - 1


def test_protect_prompt_keeps_every_prompt_token():
    model = build_arch("tiny-cla")
    cadence = Cadence(budget=16, interval=4, sink=0, recent=8, protect_prompt=True)
    P = len(PROMPT)

    def check(cache, meter):
        for positions in cache.positions:
            assert (positions < P).sum(-1).eq(P).all()
            assert positions.shape[-1] <= P + cadence.nominal + cadence.interval - 1

    g = _generate(model, "snapkv", cadence, on_step=check)
    assert g.meter.compactions > 0


def test_sampling_follows_the_request_seed():
    model = build_arch("tiny-mla")
    sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, top_p=0.95, ignore_eos=True)
    cadence = Cadence(budget=12, interval=4, sink=2)
    a, b, c = (_generate(model, "h2o", cadence, sampling, seed=s).token_ids for s in (5, 5, 6))
    assert a == b and a != c


def _run(tmp_path, *args):
    return CliRunner().invoke(main, ["run", "--quiet", "--limit", "2", "--max-new-tokens", "10", "--ignore-eos",
                                     "--temperature", "0", "--out", str(tmp_path / "out"), *args])


def test_run_cli_on_a_reference_layout_model(tmp_path):
    layout = TINY["tiny-path-mla"].cache_layout()
    res = _run(tmp_path, "--model", "tiny-path-mla", "--scorer", "h2o,full", "--budget-bytes", "8", "--fidelity",
               "--batch-size", "2")
    assert res.exit_code == 0, res.output
    dirs = sorted((tmp_path / "out").iterdir())
    assert len(dirs) == 2
    for d in dirs:
        config = json.loads((d / "config.json").read_text())["config"]
        records = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
        assert len(records) == 2 and config["model_id"] == "tiny-path-mla"
        for r in records:
            assert r["kib_per_token"] == layout.kib_per_token and r["batch_size"] == 2
            assert r["output_tokens"] == 10 and "kl_mean" in r["fidelity"]
            if config["scorer"] == "h2o":
                assert config["budget"] == 8 * 1024 // layout.bytes_per_token
                assert r["cache_mean_kib"] <= 8 and r["compactions"] > 0
            else:
                assert r["fidelity"]["kl_mean"] == 0.0
    again = _run(tmp_path, "--model", "tiny-path-mla", "--scorer", "h2o,full", "--budget-bytes", "8", "--fidelity")
    assert again.exit_code == 0 and all(
        len((d / "records.jsonl").read_text().splitlines()) == 2 for d in dirs)  # resumed: nothing added


@pytest.mark.parametrize("scorer", ["alpha", "triattention", "rkv"])
def test_key_statistic_scorers_are_refused_on_layout_models(tmp_path, scorer):
    res = _run(tmp_path, "--model", "tiny-mla", "--scorer", scorer, "--budget", "16")
    assert res.exit_code == 1 and res.output.startswith(f"Error: {scorer} cannot score the tiny-mla cache")
    assert res.output.count("\n") == 1 and not (tmp_path / "out").exists()


def test_plan_validation_refuses_them_too():
    from retention.arms import validate_arm

    with pytest.raises(RetentionError, match="cannot score the tiny-kv cache"):
        validate_arm({"model": "tiny-kv", "scorer": "alpha", "budget": 16})
    validate_arm({"model": "tiny-kv", "scorer": "snapkv", "budget": 16})


def test_layout_cache_writes_in_place_grows_and_rewinds():
    model = build_arch("tiny-mla")
    cache = model.new_cache(capacity=6)
    x = torch.randn(1, 1, 4, 3)
    held = cache.append("s", x)
    buf = held.data_ptr()
    cache.append("s", torch.ones(1, 1, 2, 3))
    assert cache.read("s").data_ptr() == buf and cache.read("s").shape[2] == 6  # in place, at capacity
    grown = cache.append("s", torch.zeros(1, 1, 1, 3))
    assert grown.data_ptr() != buf and cache.allocated_bytes() == 14 * 3 * 4  # doubled to 2 x 7
    assert torch.equal(grown[:, :, :4], x) and grown[:, :, 4:6].eq(1).all() and grown[:, :, 6].eq(0).all()
    cache.truncate(4)
    again = cache.append("s", torch.full((1, 1, 1, 3), 7.0))
    assert again.shape[2] == 5 and again[:, :, 4].eq(7).all() and torch.equal(again[:, :, :4], x)


def _requests(n: int = 5):
    """Prompts of different lengths (so rows hold different numbers of tokens and pad)."""
    g = torch.Generator().manual_seed(7)
    return [Request(f"p{i}", [int(t) for t in torch.randint(0, 256, (9 + 5 * (i % 3) + i,), generator=g)], 100 + i)
            for i in range(n)]


def _batched(model, scorer, cadence, sampling, batch_size, fidelity=True):
    from retention.arch.generate import run_arch

    done = {}
    run_arch(model, _requests(), scorer, {}, cadence, sampling, set(), model.new_cache().layout.kib_per_token,
             batch_size=batch_size, fidelity=fidelity, on_finish=lambda req, g: done.setdefault(req.key, g))
    return done


@pytest.mark.parametrize("name", _layouts())
@pytest.mark.parametrize("scorer", list(SCORERS))
def test_batch_invariance_with_refills(name, scorer):
    """The same records at batch sizes 1, 2 (refills) and 5 (padding), float64."""
    model = build_arch(name, dtype=torch.float64)
    cadence = Cadence(budget=None if scorer == "full" else 16, interval=4, sink=2,
                      recent=8 if scorer == "snapkv" else 0)
    sampling = SamplingConfig(max_new_tokens=14 + (scorer == "random"), temperature=0.0, ignore_eos=True)
    runs = [_batched(model, scorer, cadence, sampling, s) for s in (1, 2, 5)]
    for key, one in runs[0].items():
        for other in runs[1:]:
            g = other[key]
            assert g.token_ids == one.token_ids and g.meter.summary() == one.meter.summary()
            assert max(abs(a - b) for a, b in zip(g.fidelity.kl, one.fidelity.kl, strict=True)) < 1e-9
    if scorer != "full":
        assert all(g.meter.compactions > 1 for g in runs[0].values())


def test_batch_invariance_when_sampling_and_protecting_the_prompt():
    model = build_arch("tiny-path-concat", dtype=torch.float64)
    cadence = Cadence(budget=16, interval=4, sink=0, recent=8, protect_prompt=True)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.9, ignore_eos=True)
    one, five = (_batched(model, "snapkv", cadence, sampling, s, fidelity=False) for s in (1, 5))
    assert {k: g.token_ids for k, g in one.items()} == {k: g.token_ids for k, g in five.items()}


def test_eos_finishes_a_row_and_refills_it():
    model = build_arch("tiny-mla")
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)
    first = _batched(model, "h2o", Cadence(16, 4, sink=2), sampling, 1, fidelity=False)
    eos = {first["p1"].token_ids[3]}  # a token row p1 emits: it stops there
    done = {}
    from retention.arch.generate import run_arch

    run_arch(model, _requests(), "h2o", {}, Cadence(16, 4, sink=2), sampling, eos, 0.5, batch_size=2,
             on_finish=lambda req, g: done.setdefault(req.key, g))
    assert len(done) == 5 and done["p1"].finish_reason == "eos" and done["p1"].token_ids[-1] in eos
    assert len(done["p1"].token_ids) <= 4
