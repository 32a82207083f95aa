"""Generation through the retention cache: exactness vs DynamicCache, meter bounds, real eviction."""

import pytest
import torch
from transformers import DynamicCache

from retention.policy.cadence.base import Cadence
from retention.runtime.generate import SamplingConfig, _cache_kwarg, generate
from retention.policy.composite import RetentionPolicy
from retention.policy.registry import make_scorer

PROMPT = list(range(3, 70))  # 67 tokens


def reference_greedy(model, prompt, n):
    """Greedy decode with transformers' own DynamicCache: token ids and per-step logits."""
    kw = _cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    toks, logits = [], []
    with torch.inference_mode():
        lg = model(input_ids=torch.tensor([prompt]), position_ids=torch.arange(len(prompt))[None],
                   use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]
        for i in range(n):
            logits.append(lg.clone())
            t = int(lg.argmax())
            toks.append(t)
            if i == n - 1:
                break
            lg = model(input_ids=torch.tensor([[t]]), position_ids=torch.tensor([[len(prompt) + i]]),
                       use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]
    return toks, logits


def policy(name, budget, interval=None, accounting="mean", **params):
    sc = make_scorer(name, **params)
    b = budget if sc.evicts else None
    return RetentionPolicy(sc, Cadence(b, interval or (min(128, b) if b else 1), accounting, sink=sc.default_sink))


def greedy(n):
    return SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("name", ["full", "streaming", "random"])
def test_exact_vs_dynamic_cache_tiny(tiny, name):
    n = 40
    ref_toks, ref_logits = reference_greedy(tiny.model, PROMPT, n)
    g = generate(tiny.model, PROMPT, policy(name, 4096), greedy(n), set(), 1.0, keep_logits=True)
    assert g.token_ids == ref_toks
    assert all(torch.equal(a, b) for a, b in zip(g.step_logits, ref_logits))  # bit for bit
    assert g.meter.compactions == 0


def test_full_matches_transformers_generate(tiny, monkeypatch):
    """Independent reference: transformers' own greedy `generate` (EOS disabled on both sides)."""
    monkeypatch.setattr(tiny.model.generation_config, "eos_token_id", None)
    out = tiny.model.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(PROMPT) + 30
    g = generate(tiny.model, PROMPT, policy("full", None), greedy(30), set(), 1.0)
    assert g.token_ids == out[0, len(PROMPT):].tolist()


@pytest.mark.smollm
@pytest.mark.parametrize("name", ["full", "streaming", "random"])
def test_exact_vs_dynamic_cache_smollm(smollm, name):
    prompt = smollm.tokenizer("The sum of the first ten positive integers is")["input_ids"]
    n = 24
    ref_toks, ref_logits = reference_greedy(smollm.model, prompt, n)
    g = generate(smollm.model, prompt, policy(name, 4096), greedy(n), set(), 1.0, keep_logits=True)
    assert g.token_ids == ref_toks
    assert all(torch.equal(a, b) for a, b in zip(g.step_logits, ref_logits))


@pytest.mark.parametrize("name", ["streaming", "random"])
@pytest.mark.parametrize("budget,interval", [(64, 16), (40, 10), (32, 7)])
def test_meter_bounds_each_accounting_mode(tiny, name, budget, interval):
    n = 150
    means = {}
    for acc in ("mean", "peak", "prefill"):
        pol = policy(name, budget, interval, acc)
        b = pol.cadence.nominal
        g = generate(tiny.model, PROMPT, pol, greedy(n), set(), 1.0)
        m = g.meter
        assert m.steps == n - 1 and m.compactions > 0
        assert m.peak <= b + interval  # the cadence bound
        if acc == "mean":
            assert m.mean <= budget
            assert not m.exceeded
        if acc == "peak":
            assert m.peak <= budget
        if acc == "prefill":
            # the loose convention overshoots: about b + N/2 on average
            assert m.mean > budget
            assert abs(m.mean - (budget + (interval + 1) / 2)) <= interval / 4 + 1
            assert m.exceeded
        means[acc] = m.mean
    assert means["peak"] < means["mean"] < means["prefill"]


def test_eviction_is_physical(tiny, monkeypatch):
    """After every compaction each layer's view holds exactly what the meter counts, in the
    preallocated buffers (`b + N` per row: nothing is reallocated)."""
    pol = policy("streaming", 48, 12)
    seen = []

    class Spy(type(pol.scorer)):
        def compacted(self, keep, view):
            seen.append(keep.shape[-1])

    pol.scorer = Spy()
    from retention.runtime.cache import RetentionCache

    real_compact = RetentionCache.compact_rows
    sizes = []

    def compact_rows(self, rows, keep):
        real_compact(self, rows, keep)
        cap = pol.cadence.nominal + pol.cadence.interval
        for layer in self.layers:
            n = layer.get_seq_length()
            assert layer.keys.numel() == layer.keys.shape[0] * layer.keys.shape[1] * n * layer.keys.shape[-1]
            assert layer.keys.shape[-2] == layer.values.shape[-2] == layer.positions.shape[-1]
            if self.capacity == cap:  # the batch cache (the prefill's own cache holds the prompt)
                assert layer.kbuf.shape[2] == cap
            sizes.append(n)

    monkeypatch.setattr(RetentionCache, "compact_rows", compact_rows)
    g = generate(tiny.model, PROMPT, pol, greedy(100), set(), 1.0)
    assert sizes and set(sizes) == {pol.cadence.nominal}
    assert g.meter.final <= pol.cadence.nominal + pol.cadence.interval
    assert seen and set(seen) == {pol.cadence.nominal}


def test_streaming_keeps_sinks_and_recent(tiny):
    """After the prefill compaction the cache holds the 4 sinks and the newest b - 4 positions."""
    from retention.runtime.cache import RetentionCache
    from retention.runtime.generate import forward_step
    from retention.runtime.meter import BudgetMeter

    pol = policy("streaming", 40, 8)
    cache = RetentionCache(tiny.model.config.num_hidden_layers)
    with torch.inference_mode():
        forward_step(tiny.model, torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], cache, _cache_kwarg(tiny.model))
        assert pol.after_forward(cache, len(PROMPT), BudgetMeter(1.0, 40), prefill=True)
    b = pol.cadence.nominal
    for layer in cache.layers:
        for head in layer.positions[0]:
            assert head.tolist() == [0, 1, 2, 3] + list(range(len(PROMPT) - (b - 4), len(PROMPT)))


def test_sampling_is_seeded(tiny):
    cfg = SamplingConfig(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=123, ignore_eos=True)
    a = generate(tiny.model, PROMPT, policy("full", None), cfg, set(), 1.0).token_ids
    b = generate(tiny.model, PROMPT, policy("full", None), cfg, set(), 1.0).token_ids
    c = generate(tiny.model, PROMPT, policy("full", None), SamplingConfig(30, 0.8, 0.9, 124, True), set(), 1.0).token_ids
    assert a == b and a != c


def test_eos_stops(tiny):
    first = generate(tiny.model, PROMPT, policy("full", None), greedy(5), set(), 1.0).token_ids
    g = generate(tiny.model, PROMPT, policy("full", None), SamplingConfig(50, 0.0), {first[2]}, 1.0)
    assert g.finish_reason == "eos" and g.token_ids == first[:3]
    g = generate(tiny.model, PROMPT, policy("full", None), SamplingConfig(5, 0.0), set(), 1.0)
    assert g.finish_reason == "length" and len(g.token_ids) == 5


def test_fidelity_full_is_exact(tiny):
    g = generate(tiny.model, PROMPT, policy("full", None), greedy(30), set(), 1.0, fidelity=True)
    assert g.fidelity.kl == [0.0] * 30 and all(g.fidelity.top1_agree)
    s = g.fidelity.summary()
    assert s["kl_mean"] == 0.0 and s["top1_agreement"] == 1.0 and s["first_divergence_step"] is None
    g = generate(tiny.model, PROMPT, policy("random", 24, 6), greedy(60), set(), 1.0, fidelity=True)
    assert max(g.fidelity.kl) > 0
