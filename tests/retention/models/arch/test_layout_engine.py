"""Reference layout models through the one engine (`retention.runtime.engine`, as `retention run` decodes
them): exactness at an unlimited budget, meter bytes equal to the stored tensors, kept sets per
sharing group, the prompt rule, sampling seeds, batch invariance with refills, and the CLI path with
its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from retention.models.arch.configs import TINY
from retention.models.arch.model import build_arch
from retention.runtime.cache import PAD, RetentionCache
from retention.policy.cadence.base import Cadence
from retention.cli import main
from retention.runtime.engine import Engine, Request, SamplingConfig, run_engine
from retention.errors import RetentionError
from retention.models import ALIASES, load_model
from retention.policy.composite import RetentionPolicy
from retention.policy.registry import make_scorer

PROMPT = [int(t) for t in torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(3))]
GREEDY = SamplingConfig(max_new_tokens=24, temperature=0.0, ignore_eos=True)
FAST = {"tiny-kv", "tiny-mla", "tiny-path-residual"}  # the others are marked slow (`-m "not slow"` skips them)
SCORERS = ("full", "random", "streaming", "h2o", "snapkv")  # what a layout model provides for


def _layouts():
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in TINY]


def _policy(scorer, cadence):
    return RetentionPolicy(make_scorer(scorer), cadence)


def _generate(model, scorer, cadence, sampling=GREEDY, seed=0, fidelity=False, on_step=None):
    """One request through the engine; `on_step(cache, meter)` after every decode step."""
    kib = model.cache_layout().kib_per_token
    done = []
    policy = _policy(scorer, cadence)
    eng = Engine(model, [Request("p", PROMPT, seed)], policy, sampling, set(), kib, fidelity=fidelity,
                 on_finish=lambda r, g: done.append(g))
    with torch.inference_mode(), policy.attach(model):
        eng.fill()
        while eng.rows:
            meter = eng.rows[0].meter
            eng.step()
            if on_step is not None and eng.rows:
                on_step(eng.cache, meter)
    return done[0]


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
    layout = model.cache_layout()
    cadence = Cadence(budget=16, interval=4, sink=2, recent=8 if scorer == "snapkv" else 0)
    seen = []

    def check(cache, meter):
        n = cache.lengths[0]
        assert cache.nbytes() == n * layout.bytes_per_token == meter.final * layout.bytes_per_token
        # Every store sits in the eviction group of the layers that read it, gathered with the group's
        # positions: one token axis of one capacity per group.
        for g, members in enumerate(cache.groups):
            group = cache.layers[g]
            names = {s.name for s in layout.stores if cache.group_of_store[s.name] == g}
            assert set(group.stores) == names and names
            assert all(b.shape[2] == group.pbuf.shape[2] for b in group.stores.values())
            assert all(set(s.readers) <= set(members) for s in layout.stores if s.name in names)
            assert all(cache.group_of_layer[m] == g for m in members)
        # decoding: buffers of b + N tokens, written in place, never grown
        assert cache.allocated_bytes() == (cadence.nominal + cadence.interval) * layout.bytes_per_token
        seen.append(n)

    g = _generate(model, scorer, cadence, on_step=check)
    assert g.meter.compactions > 0 and max(seen) <= cadence.nominal + cadence.interval - 1  # after compaction
    assert g.meter.mean <= 16 and not g.meter.exceeded and g.meter.peak <= 16 + 4
    assert g.meter.steps == GREEDY.max_new_tokens - 1


@pytest.mark.parametrize("name", ["tiny-cla", "tiny-path-concat", "tiny-qk-norm-mla"])
def test_every_store_of_a_group_holds_the_groups_kept_tokens(name):
    """After a compaction each store of a sharing group holds exactly the tokens the group kept: the
    stored tensors equal those of a cache that was written with only those tokens in the first place
    (positions kept, so keys rotated alike)."""
    model = build_arch(name, dtype=torch.float64)
    ids = torch.tensor([PROMPT])
    pos = torch.arange(len(PROMPT))[None]
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, pos, cache)
    g = torch.Generator().manual_seed(0)
    keep = [torch.sort(torch.randperm(len(PROMPT), generator=g)[:9]).values for _ in cache.groups]
    cache.compact(torch.stack([k.expand(1, cache.layout.kv_heads, -1) for k in keep]))
    for gi, k in enumerate(keep):
        assert cache.layers[gi].positions[0, 0].tolist() == k.tolist()
        for name_, buf in cache.layers[gi].stores.items():
            fresh = model.new_cache()
            with torch.no_grad():
                model(ids, pos, fresh)
            want = fresh.read(name_)[:, :, k]
            assert torch.equal(buf[:, :, :9], want), name_


def test_protect_prompt_keeps_every_prompt_token():
    model = build_arch("tiny-cla")
    cadence = Cadence(budget=16, interval=4, sink=0, recent=8, protect_prompt=True)
    P = len(PROMPT)

    def check(cache, meter):
        for layer in cache.layers:
            assert (layer.positions < P).sum(-1).eq(P).all()
            assert layer.positions.shape[-1] <= P + cadence.nominal + cadence.interval - 1

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


# triattention and alpha read an MLA latent with its (latent) calibration (issue 20 item 4), no other layout's stores.
@pytest.mark.parametrize(("model", "scorer", "usable"), [
    ("tiny-cla", "alpha", ""), ("tiny-path-mla", "triattention", ""), ("tiny-kv", "triattention", ""),
    ("tiny-mla", "rkv", ", triattention, alpha")])
def test_key_statistic_scorers_are_refused_on_layout_models(tmp_path, model, scorer, usable):
    res = _run(tmp_path, "--model", model, "--scorer", scorer, "--budget", "16")
    assert res.exit_code == 1 and res.output.startswith(f"Error: {scorer} cannot score the {model} cache")
    assert res.output.endswith(f"use full, random, random-pp, streaming, h2o, snapkv{usable}\n")
    assert res.output.count("\n") == 1 and not (tmp_path / "out").exists()


def test_snapkv_head_rule_is_refused_on_layout_models(tmp_path):
    """The per-head rule reads queries and per-head keys; the layout modules provide attention."""
    res = _run(tmp_path, "--model", "tiny-cla", "--scorer", "snapkv", "--param", "snapkv.rule=head", "--budget", "16")
    assert res.exit_code == 1 and res.output.startswith("Error: snapkv cannot score the tiny-cla cache")
    assert res.output.count("\n") == 1 and not (tmp_path / "out").exists()


def test_plan_validation_refuses_them_too():
    from retention.runs.arms import validate_arm

    with pytest.raises(RetentionError, match="cannot score the tiny-kv cache"):
        validate_arm({"model": "tiny-kv", "scorer": "alpha", "budget": 16})
    validate_arm({"model": "tiny-kv", "scorer": "snapkv", "budget": 16})


def test_layout_cache_writes_in_place_grows_and_rewinds():
    cache = RetentionCache.for_layout(build_arch("tiny-mla").cache_layout(), capacity=6)
    x = torch.randn(1, 1, 4, 3)
    cache.begin_step(torch.arange(4)[None])
    held = cache.append("L0.c_kv", x)
    buf = held.data_ptr()
    cache.begin_step(torch.arange(4, 6)[None])
    cache.append("L0.c_kv", torch.ones(1, 1, 2, 3))
    assert cache.read("L0.c_kv").data_ptr() == buf and cache.read("L0.c_kv").shape[2] == 6  # in place, at capacity
    cache.begin_step(torch.tensor([[6]]))
    grown = cache.append("L0.c_kv", torch.zeros(1, 1, 1, 3))
    assert grown.data_ptr() != buf and cache.layers[0].capacity == 12  # doubled
    assert torch.equal(grown[:, :, :4], x) and grown[:, :, 4:6].eq(1).all() and grown[:, :, 6].eq(0).all()
    cache.truncate(4)
    cache.begin_step(torch.tensor([[4]]))
    again = cache.append("L0.c_kv", torch.full((1, 1, 1, 3), 7.0))
    assert again.shape[2] == 5 and again[:, :, 4].eq(7).all() and torch.equal(again[:, :, :4], x)


def test_padding_reads_as_a_position_after_every_query():
    cache = RetentionCache.for_layout(build_arch("tiny-kv").cache_layout(), capacity=8)
    one = RetentionCache.for_layout(cache.layout, capacity=8)
    one.begin_step(torch.arange(3)[None])
    batch = RetentionCache.for_layout(cache.layout, capacity=8)
    batch.begin_step(torch.arange(5).expand(2, -1))
    batch.load_row(1, one)
    batch.begin_step(torch.tensor([[5], [3]]))
    pos = batch.layer_positions(0)
    assert pos[0, 0].tolist() == [0, 1, 2, 3, 4, 5] and pos[1, 0].tolist() == [0, 1, 2, 3, PAD, PAD]


def _requests(n: int = 5):
    """Prompts of different lengths (so rows hold different numbers of tokens and pad)."""
    g = torch.Generator().manual_seed(7)
    return [Request(f"p{i}", [int(t) for t in torch.randint(0, 256, (9 + 5 * (i % 3) + i,), generator=g)], 100 + i)
            for i in range(n)]


def _batched(model, scorer, cadence, sampling, batch_size, fidelity=True, eos=frozenset()):
    done = {}
    run_engine(model, _requests(), _policy(scorer, cadence), sampling, set(eos), model.cache_layout().kib_per_token,
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
    done = _batched(model, "h2o", Cadence(16, 4, sink=2), sampling, 2, fidelity=False, eos=eos)
    assert len(done) == 5 and done["p1"].finish_reason == "eos" and done["p1"].token_ids[-1] in eos
    assert len(done["p1"].token_ids) <= 4


def test_a_budget_beyond_the_run_gives_the_reference_the_retained_views():
    """Batched, with fidelity, at a budget beyond the run: the reference cache's views are as wide as
    the retained cache's at every step, so that nothing evicted means the very same reductions and a
    KL of exactly 0 whatever the host's kernels do with the width (float32, static rows)."""
    model = build_arch("tiny-mla", dtype=torch.float32)
    policy = _policy("streaming", Cadence(budget=4096, interval=4, sink=1))
    done = []
    eng = Engine(model, _requests(3), policy, GREEDY, set(), model.cache_layout().kib_per_token, batch_size=2,
                 fidelity=True, on_finish=lambda r, g: done.append(g))
    widths = []
    with torch.inference_mode(), policy.attach(model):
        eng.fill()
        while eng.rows:
            eng.step()
            widths.append((eng.cache.layers[0].positions.shape[-1], eng.ref.layers[0].positions.shape[-1]))
    assert widths and all(a == b for a, b in widths), widths
    assert len(done) == 3 and all(g.compaction_seconds == [] and max(g.fidelity.kl) == 0.0 for g in done)
