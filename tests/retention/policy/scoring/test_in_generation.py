"""The scorers inside real generation: exactness at an unlimited budget, meter bounds in every
accounting mode, physical eviction, per-layer routing, and capture under --fidelity."""

from dataclasses import dataclass, field

import pytest
import torch
from transformers import DynamicCache

from retention.policy.cadence.base import Cadence
from retention.runtime.generate import SamplingConfig, _cache_kwarg, generate
from retention.policy.composite import RetentionPolicy
from retention.policy.registry import available, make_scorer

PROMPT = list(range(3, 60))  # 57 tokens
# name, extra parameters: every evicting scorer, and the per-layer variants of the query-free ones
ARMS = [
    ("triattention", {}),
    ("triattention", {"routing": "per-layer"}),
    ("alpha", {}),
    ("alpha", {"routing": "per-layer", "lam": 1.0, "radius": 0.2}),
    ("snapkv", {}),
    ("rkv", {}),
    ("h2o", {}),
    ("streaming", {}),
    ("random", {}),
    ("random-pp", {}),
]
ARM_IDS = [n + ("-" + "-".join(f"{k}{v}" for k, v in p.items()) if p else "") for n, p in ARMS]


def scorer(name, params, stats_path):
    return make_scorer(name, stats=stats_path, **params)


def cadence_for(sc, budget, interval, accounting):
    recent = sc.min_recent() if hasattr(sc, "min_recent") else 0
    return Cadence(budget, interval, accounting, sink=sc.default_sink, recent=recent)


def greedy(n):
    return SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_every_registered_evicting_scorer_is_covered():
    covered = {n for n, _ in ARMS}
    assert {n for n in available() if make_scorer(n).evicts} == covered


def reference_greedy(model, prompt, n):
    """Greedy decode with transformers' own DynamicCache: token ids and per-step logits."""
    kw = _cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    toks, logits = [], []
    with torch.inference_mode():
        pos = torch.arange(len(prompt))[None]
        lg = model(input_ids=torch.tensor([prompt]), position_ids=pos, use_cache=True, logits_to_keep=1,
                   **{kw: cache}).logits[0, -1]
        for i in range(n):
            logits.append(lg.clone())
            toks.append(int(lg.argmax()))
            if i < n - 1:
                lg = model(input_ids=torch.tensor([[toks[-1]]]), position_ids=torch.tensor([[len(prompt) + i]]),
                           use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]
    return toks, logits


@pytest.fixture(scope="module")
def reference(tiny):
    return reference_greedy(tiny.model, PROMPT, 24)


@pytest.mark.parametrize("name,params", ARMS, ids=ARM_IDS)
def test_exact_vs_dynamic_cache_when_budget_exceeds_sequence(tiny, stats_path, reference, name, params):
    sc = scorer(name, params, stats_path)
    pol = RetentionPolicy(sc, cadence_for(sc, 4096, 128, "mean"))
    g = generate(tiny.model, PROMPT, pol, greedy(24), set(), 1.0, keep_logits=True)
    ref_toks, ref_logits = reference
    assert g.meter.compactions == 0
    assert g.token_ids == ref_toks
    assert all(torch.equal(a, b) for a, b in zip(g.step_logits, ref_logits))  # bit for bit
    assert tiny.model.config._attn_implementation == "sdpa"  # capture scorers restored it


@dataclass
class CheckedPolicy(RetentionPolicy):
    """Checks physical eviction after every forward and records the positions after compactions."""

    kept_positions: list = field(default_factory=list)

    def after_forward(self, cache, next_position, meter, prefill, tokens=None):
        did = super().after_forward(cache, next_position, meter, prefill, tokens)
        b, n_int = self.cadence.nominal, self.cadence.interval
        for layer, n in zip(cache.layers, cache.stored_lengths()):
            bsz, g, _, d = layer.keys.shape
            # Evicted tokens are gone from memory: tensors hold exactly the stored count.
            assert layer.keys.numel() == bsz * g * n * d and layer.values.numel() == bsz * g * n * d
            assert layer.positions.shape == (bsz, g, n)
            assert n < b + n_int
            if did:
                assert n == b
                # kept tokens stay in position order (distinct, ascending)
                assert bool((layer.positions.diff(dim=-1) > 0).all())
        if did:
            self.kept_positions.append((next_position, [layer.positions.clone() for layer in cache.layers]))
        return did


@pytest.mark.parametrize("name,params", ARMS, ids=ARM_IDS)
def test_meter_bounds_and_physical_eviction(tiny, stats_path, name, params):
    budget, interval, n_new = 24, 8, 40
    for accounting in ("mean", "peak", "prefill"):
        sc = scorer(name, params, stats_path)
        pol = CheckedPolicy(sc, cadence_for(sc, budget, interval, accounting))
        g = generate(tiny.model, PROMPT, pol, greedy(n_new), set(), 1.0)
        m, b = g.meter, pol.cadence.nominal
        assert len(g.token_ids) == n_new and m.compactions >= 4
        assert m.peak <= b + interval
        if accounting == "mean":
            assert m.mean <= budget and not m.exceeded
        if accounting == "peak":
            assert m.peak <= budget
        r = pol.cadence.recent
        if r:
            # window-based scorers keep their window: the newest `r` positions survive every compaction
            assert name in ("snapkv", "rkv", "h2o")
            for t, layers in pol.kept_positions:
                assert all(bool((p[..., -r:] == torch.arange(t - r, t)).all()) for p in layers)


@pytest.mark.parametrize("name,params", [("triattention", {}), ("triattention", {"routing": "per-layer"}),
                                         ("snapkv", {})])
def test_routing_shared_vs_per_layer(tiny, stats_path, name, params):
    sc = scorer(name, params, stats_path)
    pol = CheckedPolicy(sc, cadence_for(sc, 24, 8, "mean"))
    generate(tiny.model, PROMPT, pol, greedy(30), set(), 1.0)
    same = [all(torch.equal(layers[0], p) for p in layers[1:]) for _, layers in pol.kept_positions]
    if sc.per_layer:
        assert not all(same)  # layers choose their own tokens
    else:
        assert all(same)  # one kept set per KV head for every layer


@pytest.mark.parametrize("name", ["snapkv", "h2o"])
def test_fidelity_reference_forward_does_not_leak_into_captured_queries(tiny, name):
    """generate(fidelity=True) also runs each step through a full DynamicCache; the scorer must use
    only the queries computed against the retention cache, so the tokens do not change."""
    runs = []
    for fidelity in (False, True):
        sc = make_scorer(name)
        g = generate(tiny.model, PROMPT, RetentionPolicy(sc, cadence_for(sc, 24, 8, "mean")), greedy(30), set(), 1.0,
                     fidelity=fidelity)
        runs.append(g)
    assert runs[0].meter.compactions >= 3
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[1].fidelity.summary()["steps"] == 30  # prefill + 29 decode steps compared


def test_cli_configuration_of_new_scorers(tmp_path):
    """run_cmd.build_arm_config gives window scorers their protected window, records parameters and
    names the statistics file by its content hash."""
    import hashlib
    import json

    from retention.runs.arms import build_arm_config
    from retention.errors import RetentionError

    stats = tmp_path / "stats.safetensors"
    stats.write_bytes(b"not really statistics")
    base = {"model": "tiny-random", "budget": 64, "interval": None, "sink": None, "recent": None, "accounting": "mean"}
    with pytest.raises(RetentionError, match="retention calibrate"):
        build_arm_config(base, "alpha", {"stats": str(tmp_path / "missing.safetensors")})
    options = {"lam": 0.3, "radius": None, "window": 4, "routing": "per-layer", "stats": str(stats)}
    for name in ("snapkv", "rkv", "h2o"):
        spec = build_arm_config(base, name, options)
        assert spec.cadence.recent == 4 and spec.scorer_params["window"] == 4
    spec = build_arm_config(base, "alpha", options)
    params, config = spec.scorer_params, spec.config
    assert params == {"lam": 0.3, "radius": 0.0, "stats": str(stats.resolve())}
    assert config["scorer_params"]["routing"] == "per-layer" and spec.routing.name == "per-layer"
    assert spec.cadence.recent == 0
    assert config["stats_sha256"] == hashlib.sha256(stats.read_bytes()).hexdigest()
    params = build_arm_config(base, "rkv", options).scorer_params
    assert params["lam"] == 0.3
    json.dumps(params)
