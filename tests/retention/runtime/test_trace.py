"""Cache traces (`--trace`): the encoding round-trips, tracing changes nothing a run decodes, a
trace reproduces its meter's mean cache and compaction count exactly (recounted here from the JSON
alone) for every kind of compaction, and a long generation's trace stays small."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from protocol.io import jsonl_line
from retention.errors import RetentionError
from retention.policy.cadence.newline import NewlineCadence
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.registry import make_mechanism
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.runtime.trace import (CacheTrace, CacheTracer, Compaction, NullTracer, pack_positions,
                                     unpack_positions)
from retention.policy.registry import make_scorer
from retention.policy.scoring.calibration import calibrate

PROMPTS = [list(range(3 + i, 16 + 8 * i)) for i in range(8)]  # 13..69 tokens


class _FifthIsNewline:
    """A tokenizer for the newline cadence in which every fifth id is a line break (tiny-random
    rarely samples its one "\n"), so compactions wait for one a varying number of steps."""

    def __len__(self):
        return 259

    def batch_decode(self, ids):
        return ["\n" if i % 5 == 0 else "x" for (i,) in ids]


# --------------------------------------------------------------------------------------------------
# the recount, from the JSON alone (no code of retention.runtime.trace)


def _bits(text: str, n: int) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    assert raw.size == (n + 7) // 8  # one bit per position 0..n-1
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def recount(cache: dict) -> tuple[float, int, list[int]]:
    """(mean stored tokens per (layer, head) over decode steps, compactions, stored per step) from a
    trace's `cache` object, checking on the way that each kept set is a subset of what was stored."""
    n, P = cache["n_positions"], cache["prompt_tokens"]
    G, H = cache["groups"], cache["kv_heads"]
    stored = np.zeros((G, H, n), dtype=bool)
    stored[:, :, :cache["prefill_stored"]] = True
    last = 0  # output tokens generated when `stored` was last updated (0: the prefill)
    events = {c["step"]: c for c in cache["compactions"]}
    assert len(events) == len(cache["compactions"])  # at most one compaction per step and sequence
    per_step = []

    def apply(c):
        nonlocal stored
        kept = np.stack([np.stack([_bits(t, n) for t in heads]) for heads in c["positions"]])
        assert kept.shape == (G, H, n)
        assert (kept <= stored).all()  # only what the cache held can be kept
        assert c["before"] == int(stored.sum(-1).max())  # the widest (group, head)
        assert kept.sum(-1).tolist() == c["kept"]
        for name in ("merged", "quantised"):
            if name in c:
                flags = np.stack([np.stack([_bits(t, n) for t in heads]) for heads in c[name]])
                assert (flags <= kept).all()  # a state flags kept tokens only
        stored = kept

    for j in range(cache["steps"]):  # decode step j writes position P + j (output token j)
        if j in events:
            apply(events[j])
        stored[:, :, P + j] = True
        per_step.append(float(stored.sum(-1).mean()))  # the meter's mean over (layer, head): ragged when allocated
    if cache["steps"] in events:  # a compaction after the last decode step (counted, never attended)
        apply(events[cache["steps"]])
    assert all(s <= cache["steps"] for s in events)
    # no decode step: the meter reports what the prefill (and its compaction) left stored
    mean = sum(per_step) / len(per_step) if per_step else float(stored.sum(-1).mean())
    return mean, len(cache["compactions"]), per_step


# --------------------------------------------------------------------------------------------------
# encoding


@pytest.mark.parametrize("n", [1, 7, 8, 9, 130])
def test_bitsets_round_trip(n):
    rng = np.random.default_rng(n)
    bits = rng.random(n) < 0.4
    text = pack_positions(bits)
    assert (unpack_positions(text, n) == bits).all()
    assert (_bits(text, n) == bits).all()  # bit i of the bytes, little-endian, is position i
    one = np.zeros(n, dtype=bool)
    one[n - 1] = True
    assert base64.b64decode(pack_positions(one))[-1] == 1 << ((n - 1) % 8)


def _hand_made() -> CacheTrace:
    n, P = 20, 6
    kept1 = np.zeros(n, bool)
    kept1[[0, 1, 2, 3, 4, 5, 9]] = True  # the whole prompt and one generated token
    kept2 = kept1.copy()
    kept2[[2, 3]] = False  # two prompt positions go, in head 1 only
    kept2[[12, 13]] = True
    g = lambda *xs: ((tuple(pack_positions(x) for x in xs)),)  # noqa: E731
    return CacheTrace(prompt_tokens=P, n_positions=n, kv_heads=2, groups=1, layers=3, prefill_stored=P,
                      compactions=(Compaction(5, 11, ((7, 7),), g(kept1, kept1)),
                                   Compaction(9, 11, ((7, 7),), g(kept1, kept2), quantised=g(kept1, kept1 & kept2))),
                      steps=13, kl=(0.0, 0.125), top1="10")


def test_trace_json_round_trip_and_prompt_summary():
    tr = _hand_made()
    obj = json.loads(json.dumps(tr.to_json()))
    assert obj["version"] == 1 and "merged" not in obj["compactions"][0] and "quantised" in obj["compactions"][1]
    assert CacheTrace.from_json(obj) == tr
    assert tr.prompt_evicted_step == 9  # the first compaction kept the whole prompt
    assert tr.prompt_held_final == pytest.approx((6 / 6 + 4 / 6) / 2)
    with pytest.raises(RetentionError, match="version 2"):
        CacheTrace.from_json(dict(obj, version=2))
    never = CacheTrace(6, 20, 2, 1, 3, 6, (), 13)
    assert never.prompt_evicted_step is None and never.prompt_held_final is None


# --------------------------------------------------------------------------------------------------
# runs


def _policy(scorer, stats, budget=24, interval=6, protect_prompt=False, state=None, routing=None, newline=False,
            scorer_params=None):
    sc = make_scorer(scorer, **({"stats": stats} if scorer in ("triattention", "alpha") else {}), **(scorer_params or {}))
    cad = cadence_for(sc, budget, interval, protect_prompt=protect_prompt,
                      **({"kind": NewlineCadence, "params": {"max_wait": 4}} if newline else {}))
    extra = {}
    if state:
        extra["state"] = make_mechanism("state", state[0], state[1])
    if routing:
        name, params = (routing, {}) if isinstance(routing, str) else routing
        extra["routing"] = make_mechanism("routing", name, params)
    return RetentionPolicy(sc, cad, **extra)


def _decode(model, policy, prompts=PROMPTS, batch_size=1, fidelity=False, new=30, tokenizer=None):
    if tokenizer is not None:
        policy.prepare(tokenizer)
    out = {}
    reqs = [Request(i, p, i) for i, p in enumerate(prompts)]
    run_engine(model, reqs, policy, SamplingConfig(max_new_tokens=new, temperature=0.8), set(), 1.0,
               batch_size=batch_size, fidelity=fidelity, on_finish=lambda r, g: out.__setitem__(r.key, g))
    return out


def test_default_policy_records_nothing(tiny64, stats_path):
    pol = _policy("h2o", stats_path)
    assert type(pol.tracer) is NullTracer
    assert all(g.trace is None for g in _decode(tiny64, pol, PROMPTS[:2]).values())


CASES = {  # name: (policy arguments, batch size, fidelity)
    "streaming": (dict(scorer="streaming"), 1, False),
    "h2o-batch3-refills": (dict(scorer="h2o"), 3, True),
    "snapkv-per-layer-native": (dict(scorer="snapkv"), 4, False),
    "triattention-shared": (dict(scorer="triattention", routing="shared"), 8, False),
    "alpha-per-layer": (dict(scorer="alpha", routing="per-layer"), 3, False),
    "random-protect-prompt": (dict(scorer="random", protect_prompt=True), 3, False),
    "h2o-newline": (dict(scorer="h2o", newline=True), 3, False),
    "streaming-quant": (dict(scorer="streaming", state=("quant", {"residual": 4, "group": 4})), 3, False),
    "h2o-merge": (dict(scorer="h2o", state=("merge", {"threshold": -1.0})), 3, False),
    # allocating routings: ragged (layer, head) counts, padded kept indices (-1 after each count)
    "snapkv-pyramidkv": (dict(scorer="snapkv", scorer_params={"window": 2}, routing=("pyramidkv", {"beta": 20})), 3, False),
    "snapkv-adakv": (dict(scorer="snapkv", scorer_params={"window": 2}, routing=("adakv", {"alpha": 0.2})), 3, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trace_reproduces_the_meter(tiny, tiny64, stats_path, case):
    """The traced run decodes what the untraced run decodes, and each sequence's trace recounts its
    meter's `cache_mean_tokens` exactly (==) and its `compactions`."""
    kwargs, bs, fidelity = CASES[case]
    tok = _FifthIsNewline() if kwargs.get("newline") else tiny.tokenizer
    plain = _decode(tiny64, _policy(stats=stats_path, **kwargs), batch_size=bs, fidelity=fidelity, tokenizer=tok)
    traced_policy = _policy(stats=stats_path, **kwargs)
    traced_policy.tracer = CacheTracer()
    traced = _decode(tiny64, traced_policy, batch_size=bs, fidelity=fidelity, tokenizer=tok)
    groups, states = set(), set()
    for i, g in traced.items():
        assert g.token_ids == plain[i].token_ids and g.meter.summary() == plain[i].meter.summary()
        cache = json.loads(json.dumps(g.trace.to_json()))
        assert cache["prompt_tokens"] == len(PROMPTS[i]) and cache["n_positions"] == len(PROMPTS[i]) + len(g.token_ids)
        assert cache["layers"] == 4 and cache["kv_heads"] == 2 and cache["steps"] == g.meter.steps
        mean, compactions, _ = recount(cache)
        assert mean == g.meter.mean and compactions == g.meter.compactions
        groups.add(cache["groups"])
        states |= {k for c in cache["compactions"] for k in ("merged", "quantised")
                   if k in c and any(_bits(t, cache["n_positions"]).any() for h in c[k] for t in h)}
        if fidelity:
            assert len(cache["kl"]) == len(cache["top1"]) == g.meter.steps + 1
            assert cache["top1"].count("1") == sum(g.fidelity.top1_agree)
        if kwargs.get("protect_prompt"):
            assert g.trace.prompt_evicted_step is None
            assert g.trace.prompt_held_final in (None, 1.0)
    assert sum(g.meter.compactions for g in traced.values()) >= len(PROMPTS)  # the mechanism ran
    if "per-layer" in case:
        assert groups == {4}
    if case in ("streaming", "triattention-shared"):
        assert groups == {1}
    if "state" in kwargs:
        assert states == {"quantised" if kwargs["state"][0] == "quant" else "merged"}
    if case.endswith(("pyramidkv", "adakv")):  # the routing's counts are traced, and they differ by head or layer
        comps = [c for g in traced.values() for c in g.trace.to_json()["compactions"]]
        allocated = [c for c in comps if "allocation" in c]
        assert allocated and all(c["allocation"] == c["kept"] for c in allocated)
        assert any(len({n for heads in c["kept"] for n in heads}) > 1 for c in allocated)
    if kwargs.get("newline"):  # compactions at a line break come before b + N + max_wait tokens
        before = {c.before for g in traced.values() for c in g.trace.compactions if c.step > 0}
        assert len(before) > 1


# --------------------------------------------------------------------------------------------------
# size: 1,024 tokens on a 24-layer model


@pytest.fixture(scope="module")
def deep():
    from retention.models.tiny import build_tiny_random

    model, _tok = build_tiny_random(layers=24)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1))
    return model, calibrate(model, ids)


# bytes of one record's `cache` object as a trace line writes it, at budget 128, prompt 100 tokens
SIZE_BOUNDS = {"shared": 5_000, "per-layer": 100_000}


@pytest.mark.parametrize("routing", list(SIZE_BOUNDS))
def test_trace_of_a_long_generation_stays_small(deep, tmp_path, routing):
    model, stats = deep
    path = str(stats.save(tmp_path / "deep.safetensors"))
    sc = make_scorer("triattention", stats=path).structured(routing)
    pol = RetentionPolicy(sc, cadence_for(sc, 128))
    pol.tracer = CacheTracer()
    out = []
    run_engine(model, [Request(0, list(range(100)), 0)], pol, SamplingConfig(max_new_tokens=1024, ignore_eos=True),
               set(), 1.0, on_finish=lambda r, g: out.append(g))
    (g,) = out
    cache = g.trace.to_json()
    size = len(jsonl_line(cache))
    print(f"{routing}: {size} bytes, {len(cache['compactions'])} compactions, {cache['groups']} group(s)")
    assert cache["layers"] == 24 and cache["groups"] == (24 if routing == "per-layer" else 1)
    assert len(cache["compactions"]) == g.meter.compactions >= 8
    assert recount(cache)[0] == g.meter.mean
    assert size < SIZE_BOUNDS[routing]
