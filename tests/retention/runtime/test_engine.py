"""The batched engine: batch invariance for every scorer, exactness at an unlimited budget, meter
bounds per sequence, slot refill never leaking the previous sequence, seeded sampling at any batch."""

from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

from retention.runtime.engine import Request, SamplingConfig, cache_kwarg, run_engine
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.policy.registry import available, make_scorer

# Eight prompts of different lengths (13..69 tokens), so rows are padded and compact at different steps.
PROMPTS = [list(range(3 + i, 16 + 8 * i)) for i in range(8)]
SCORERS = ["full", "random", "streaming", "triattention", "alpha", "snapkv", "rkv", "h2o"]


def make_policy(name, stats_path, budget=20, interval=4, accounting="mean", protect_prompt=False):
    sc = make_scorer(name, stats=stats_path)
    return RetentionPolicy(sc, cadence_for(sc, budget, interval, accounting, protect_prompt=protect_prompt))


def decode(model, prompts, policy, cfg, eos=frozenset(), batch_size=1, seeds=None, **kw):
    """{request index: Generation} from one engine run over `prompts`."""
    out = {}
    reqs = [Request(i, p, (seeds or {}).get(i, i)) for i, p in enumerate(prompts)]
    stats = run_engine(model, reqs, policy, cfg, set(eos), 1.0, batch_size=batch_size,
                       on_finish=lambda r, g: out.__setitem__(r.key, g), **kw)
    return out, stats


def assert_logits_agree(a, b, tol=1e-5):
    """float32 logits agree to `tol` relative to the logit scale (max |logit|, ~6.5 on tiny-random,
    whose large random weights amplify rounding: batched GEMMs and masked attention round differently)."""
    scale = float(b.abs().max().clamp(min=1.0))
    assert float((a - b).abs().max()) <= tol * scale


# `random-pp` is `random` at Random Attention's preset (a 64-token window, wider than this file's
# b = 20): its engine behaviour is `random`'s, its preset is checked in runs/test_conformance_random.py.
PRESETS = {"random-pp"}


def test_every_scorer_is_covered():
    assert set(SCORERS) | PRESETS == set(available())


@pytest.fixture(scope="module")
def eos_ids(tiny64, stats_path):
    """Token ids that end the eight sequences at different steps (read off a full-cache decode)."""
    cfg = SamplingConfig(max_new_tokens=24, ignore_eos=True)
    gens, _ = decode(tiny64, PROMPTS, make_policy("full", stats_path), cfg, batch_size=8)
    return {gens[i].token_ids[4 + 3 * i] for i in range(0, 8, 2)}


@pytest.mark.parametrize("name,protect_prompt,sizes", [(n, False, (8,)) for n in SCORERS]
                         + [("h2o", False, (3,)), ("alpha", True, (8, 3)), ("snapkv", True, (8,))],
                         ids=[*SCORERS, "h2o-refill3", "alpha-protect-prompt", "snapkv-protect-prompt"])
def test_batch_invariance_float64(tiny64, stats_path, eos_ids, name, protect_prompt, sizes):
    """Each sequence decoded in a batch of 8 mixed prompts (or of 3, refilled as slots free) has
    exactly the token ids, finish reason and meter of the same sequence decoded alone."""
    cfg = SamplingConfig(max_new_tokens=24)
    pol = lambda: make_policy(name, stats_path, protect_prompt=protect_prompt)  # noqa: E731
    alone = {i: decode(tiny64, [p], pol(), cfg, eos_ids, seeds={0: i})[0][0] for i, p in enumerate(PROMPTS)}
    assert len({len(g.token_ids) for g in alone.values()}) >= 3  # different EOS times
    for bs in sizes:
        batched, _ = decode(tiny64, PROMPTS, pol(), cfg, eos_ids, batch_size=bs)
        for i, g in alone.items():
            b = batched[i]
            assert b.token_ids == g.token_ids, (bs, i)
            assert b.finish_reason == g.finish_reason
            assert b.meter.summary() == g.meter.summary()
    if name != "full":
        assert any(g.meter.compactions > 0 for g in alone.values())


@pytest.mark.parametrize("name", ["streaming", "alpha", "h2o"])
def test_batched_logits_float32(tiny, stats_path, name):
    cfg = SamplingConfig(max_new_tokens=16, ignore_eos=True)
    batched, _ = decode(tiny.model, PROMPTS, make_policy(name, stats_path), cfg, batch_size=8, keep_logits=True)
    for i in (0, 3, 6):
        p = PROMPTS[i]
        g = decode(tiny.model, [p], make_policy(name, stats_path), cfg, keep_logits=True, seeds={0: i})[0][0]
        assert batched[i].token_ids == g.token_ids
        for a, b in zip(batched[i].step_logits, g.step_logits):
            assert_logits_agree(a, b)


def dynamic_cache_greedy(model, prompt, n):
    """Greedy decode of one sequence with transformers' own DynamicCache: ids and per-step logits."""
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    toks, logits = [], []
    with torch.inference_mode():
        lg = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]
        for _ in range(n):
            logits.append(lg)
            toks.append(int(lg.argmax()))
            lg = model(input_ids=torch.tensor([[toks[-1]]]), use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]
    return toks, logits


@pytest.mark.parametrize("name", ["full", "streaming"])
def test_unlimited_budget_equals_dynamic_cache(tiny, stats_path, name):
    """At a budget no sequence reaches, every batched slot decodes what DynamicCache decodes alone."""
    n = 12
    cfg = SamplingConfig(max_new_tokens=n, ignore_eos=True)
    batched, _ = decode(tiny.model, PROMPTS, make_policy(name, stats_path, budget=4096, interval=None), cfg,
                        batch_size=5, keep_logits=True)
    for i, p in enumerate(PROMPTS):
        toks, logits = dynamic_cache_greedy(tiny.model, p, n)
        assert batched[i].token_ids == toks and batched[i].meter.compactions == 0
        for a, b in zip(batched[i].step_logits, logits):
            assert_logits_agree(a, b)


@dataclass
class CheckedPolicy(RetentionPolicy):
    """After every forward: each row's meter counts what its row stores, and the view holds it."""

    def after_forward(self, cache, next_position, meter, prefill, tokens=None):
        meters = [meter] if cache.rows == 1 else meter
        valid = cache.valid_mask()
        for r, m in enumerate(meters):
            assert int(valid[r].sum()) == cache.lengths[r] == m.final
        per_token = sum(2 * ly.kbuf[0, :, 0].numel() * ly.kbuf.element_size() for ly in cache.layers)
        assert cache.stored_bytes() == per_token * sum(cache.lengths)
        return super().after_forward(cache, next_position, meter, prefill, tokens)


@pytest.mark.parametrize("accounting", ["mean", "peak", "prefill"])
def test_meter_bounds_per_sequence_batched(tiny, stats_path, accounting):
    budget, interval = 20, 4
    sc = make_scorer("h2o")
    pol = CheckedPolicy(sc, cadence_for(sc, budget, interval, accounting))
    b = pol.cadence.nominal
    cfg = SamplingConfig(max_new_tokens=24, ignore_eos=True)
    gens, stats = decode(tiny.model, PROMPTS, pol, cfg, batch_size=4)
    for g in gens.values():
        m = g.meter
        assert m.steps == 23 and m.compactions >= 3 and m.peak <= b + interval
        if accounting == "mean":
            assert m.mean <= budget and not m.exceeded
        elif accounting == "peak":
            assert m.peak <= budget
        else:
            assert m.mean > budget and m.exceeded
    # Allocated = rows x (b + N) x bytes per token exactly (K and V, 4 layers, 2 heads, d 16, float32).
    assert stats.allocated_bytes == 4 * (b + interval) * 4 * 2 * 2 * 16 * 4


def test_refilled_slot_never_sees_the_previous_sequence(tiny, stats_path, monkeypatch):
    """Oracle: poison every row's buffer past its stored length whenever a row is (re)loaded; a
    sequence started in a reused slot still decodes exactly what it decodes alone."""
    from retention.runtime.cache import RetentionCache

    real = RetentionCache.load_row

    def poisoned(self, row, src, src_row=0):
        real(self, row, src, src_row)
        n = self.lengths[row]
        for layer in self.layers:
            layer.kbuf[row, :, n:] = 1e4
            layer.vbuf[row, :, n:] = -1e4

    monkeypatch.setattr(RetentionCache, "load_row", poisoned)
    cfg = SamplingConfig(max_new_tokens=16)
    first, _ = decode(tiny.model, PROMPTS[:1], make_policy("full", stats_path), cfg)
    eos = {first[0].token_ids[3]}  # the long first sequence ends early, its slot is refilled
    prompts = [PROMPTS[7], PROMPTS[0], PROMPTS[1], PROMPTS[6]]
    batched, _ = decode(tiny.model, prompts, make_policy("streaming", stats_path), cfg, eos, batch_size=2,
                        keep_logits=True)
    for i, p in enumerate(prompts):
        g = decode(tiny.model, [p], make_policy("streaming", stats_path), cfg, eos, keep_logits=True)[0][0]
        assert batched[i].token_ids == g.token_ids
        for a, b in zip(batched[i].step_logits, g.step_logits):
            assert_logits_agree(a, b)


def test_sampling_does_not_depend_on_the_batch(tiny64, stats_path):
    cfg = SamplingConfig(max_new_tokens=20, temperature=0.9, top_p=0.9, ignore_eos=True)
    seeds = {i: 1000 + i for i in range(8)}
    one, _ = decode(tiny64, PROMPTS, make_policy("alpha", stats_path), cfg, batch_size=1, seeds=seeds)
    eight, _ = decode(tiny64, PROMPTS, make_policy("alpha", stats_path), cfg, batch_size=8, seeds=seeds)
    assert all(one[i].token_ids == eight[i].token_ids for i in range(8))
    other, _ = decode(tiny64, PROMPTS, make_policy("alpha", stats_path), cfg, batch_size=8,
                      seeds={i: 2000 + i for i in range(8)})
    assert any(one[i].token_ids != other[i].token_ids for i in range(8))


def test_fidelity_batched_equals_alone(tiny64, stats_path):
    cfg = SamplingConfig(max_new_tokens=16, ignore_eos=True)
    batched, _ = decode(tiny64, PROMPTS, make_policy("alpha", stats_path), cfg, batch_size=8, fidelity=True)
    for i in (0, 2, 4, 6):
        p = PROMPTS[i]
        g = decode(tiny64, [p], make_policy("alpha", stats_path), cfg, fidelity=True, seeds={0: i})[0][0]
        a, b = batched[i].fidelity.summary(), g.fidelity.summary()
        assert a["first_divergence_step"] == b["first_divergence_step"] and a["steps"] == b["steps"] == 16
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-9, abs=1e-12)
    assert max(g.fidelity.summary()["kl_max"] for g in batched.values()) > 0


@pytest.mark.parametrize("sampler", ["inverse-cdf", "multinomial"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.8, 1.0), (0.8, 0.9)])
def test_one_host_read_per_decode_step(tiny, stats_path, temperature, top_p, sampler, monkeypatch):
    """Sampled or greedy, with fidelity: every host read of the run is one the engine counts, one
    per decode step and one per started sequence (the module docstring's list; on a CPU the nucleus
    adds one per sampling call, the inverse-CDF draw two where a row's nucleus passes its first
    candidates)."""
    from retention.runtime import sampling

    # Below tiny-random's 256 tokens: the CPU's reads. 2 candidates: some rows need the second tier.
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 64)
    monkeypatch.setattr(sampling, "DRAW_CANDIDATES", 2)
    from retention.runtime.engine import Engine
    from retention.runtime.syncs import count_host_reads

    cfg = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=top_p, ignore_eos=True, sampler=sampler)
    policy = make_policy("full", stats_path)
    eng = Engine(tiny.model, [Request(i, p, i) for i, p in enumerate(PROMPTS)], policy, cfg, set(), 1.0,
                 batch_size=3, fidelity=True)
    with torch.inference_mode(), policy.attach(tiny.model), count_host_reads() as counts:
        eng.fill()
        while not eng.done:
            eng.step()
    st = eng.stats
    assert st.finished == len(PROMPTS) and st.padding_rows > 0  # the tail ran on padding rows
    starts = len(PROMPTS)
    if top_p == 1 or sampler == "multinomial":
        extra = int(top_p < 1)
        assert st.host_syncs == (1 + extra) * st.steps and st.start_syncs == (2 + extra) * starts
    else:  # one read per draw, two where a row's nucleus reached past the first candidates
        assert 2 * st.steps <= st.host_syncs <= 3 * st.steps and 3 * starts <= st.start_syncs <= 4 * starts
        assert st.host_syncs + st.start_syncs > 2 * st.steps + 3 * starts  # the second tier ran
    assert counts["all"] == st.host_syncs + st.start_syncs + st.tail_syncs


def test_fidelity_kl_is_the_written_out_sum():
    """`step_agreement`'s fused KL is sum p (log p - log q) in float64, bit for bit."""
    from retention.runtime.fidelity import step_agreement

    g = torch.Generator().manual_seed(0)
    ref = (torch.randn(5, 3000, generator=g) * 3).to(torch.bfloat16)
    lg = ref + (torch.randn(5, 3000, generator=g) * 0.5).to(torch.bfloat16)
    p, q = torch.log_softmax(ref.double(), -1), torch.log_softmax(lg.double(), -1)
    kl, agree = step_agreement(ref, lg)
    assert torch.equal(kl, (p.exp() * (p - q)).sum(-1).clamp(min=0.0))
    assert torch.equal(agree, ref.argmax(-1) == lg.argmax(-1))


def test_padding_rows_are_never_due(stats_path):
    """A padding row of the static step (meter None) is never compacted, whatever it holds."""
    from retention.runtime.cache import RetentionCache

    pol = make_policy("streaming", stats_path)
    full = pol.cadence.nominal + pol.cadence.interval
    cache = RetentionCache(1)
    cache.lengths, cache.prompt_lengths, cache.slots = [full, full], [3, 3], [0, 1]
    assert pol.due_rows(cache, prefill=False) == [0, 1]
    assert pol.due_rows(cache, prefill=False, active=[False, True]) == [1]


@pytest.mark.parametrize("name,shared", [("triattention", 3), ("alpha", 3), ("snapkv", 0)])
@pytest.mark.parametrize("batch_size", [6, 2])
def test_repeated_prompts_share_one_prefill(tiny, stats_path, name, shared, batch_size):
    """Requests that repeat the prompt started just before them (samples of one problem) start from a copy
    of its forward: the same token ids, logits and meters as with a forward each; a scorer that reads the
    forward itself (snapkv's recorded queries) prefills each prompt."""
    a, b = PROMPTS[5], PROMPTS[2]
    prompts = [a, a, a, b, b, a]
    cfg = SamplingConfig(max_new_tokens=14, temperature=0.9, top_p=0.95, ignore_eos=True)
    seeds = {i: 500 + i for i in range(6)}
    on, st_on = decode(tiny.model, prompts, make_policy(name, stats_path), cfg, batch_size=batch_size,
                       seeds=seeds, keep_logits=True)
    off, st_off = decode(tiny.model, prompts, make_policy(name, stats_path), cfg, batch_size=batch_size,
                         seeds=seeds, keep_logits=True, share_prefill=False)
    for i in range(6):
        assert on[i].token_ids == off[i].token_ids
        assert all(torch.equal(x, y) for x, y in zip(on[i].step_logits, off[i].step_logits))
        assert on[i].meter.summary() == off[i].meter.summary()
    assert on[0].token_ids != on[1].token_ids  # the samples differ: only the prefill is shared
    assert (st_off.prefill_batches, st_off.shared_prefills) == (6, 0)
    # Batch 2 starts (a, a), then refills (a, b), (b, a) as both slots free at the same step: one copy.
    want = shared if batch_size == 6 else min(shared, 1)
    assert (st_on.prefill_batches, st_on.shared_prefills) == (6 - want, want)
