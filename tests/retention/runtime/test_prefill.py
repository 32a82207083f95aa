"""Batched prefill (issue 48, item 5a): the prompts that start together share right-padded forwards
and give the same records as prompts prefilled one at a time; scorers that learn from the forward
itself are still prefilled alone."""

from __future__ import annotations

import pytest
import torch

from retention.runtime.adapter import ModelAdapter
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.runtime.prefill import PREFILL_CHUNK_TOKENS, chunks, prefill_batch
from retention.policy.registry import available, make_scorer, get_scorer_class

# Twelve prompts of 13..101 tokens: rows padded by up to 88 tokens, refills at S = 5 start in groups.
PROMPTS = [list(range(3 + i, 16 + 8 * i)) for i in range(12)]


def _policy(name, stats_path, budget=20):
    sc = make_scorer(name, stats=stats_path)
    return RetentionPolicy(sc, cadence_for(sc, budget, 4))


def _decode(model, policy, batch_size, batch_prefill, prompts=PROMPTS, **kw):
    out = {}
    reqs = [Request(i, p, i) for i, p in enumerate(prompts)]
    stats = run_engine(model, reqs, policy, SamplingConfig(max_new_tokens=12, ignore_eos=True), set(), 1.0,
                       batch_size=batch_size, batch_prefill=batch_prefill, keep_logits=True,
                       on_finish=lambda r, g: out.__setitem__(r.key, g), **kw)
    return out, stats


def test_chunks_fit_the_token_budget():
    assert chunks([10, 20, 30], budget=60) == [[0, 1], [2]]  # 3 x 30 = 90 > 60
    assert chunks([10, 20, 30], budget=90) == [[0, 1, 2]]
    assert chunks([100, 5], budget=50) == [[1], [0]]  # a prompt over the budget goes alone
    assert chunks([30, 10, 29, 11], budget=60) == [[1, 3], [2, 0]]  # by length: little padding
    lengths = [int(n) for n in torch.randint(1, 700, (64,), generator=torch.Generator().manual_seed(0))]
    groups = chunks(lengths)
    assert sorted(i for g in groups for i in g) == list(range(64))
    order = [lengths[i] for g in groups for i in g]
    assert order == sorted(order)
    assert all(len(g) == 1 or len(g) * max(lengths[i] for i in g) <= PREFILL_CHUNK_TOKENS for g in groups)


def test_prefill_batch_rows_equal_prefills_alone(tiny):
    """Each row's cache holds its own prompt's tokens (keys, values, positions) and the first-token
    logits are read at its own last prompt token, as a prefill alone gives them (float32)."""
    ad = ModelAdapter(tiny.model)
    prompts = PROMPTS[:5]
    with torch.inference_mode():
        logits, caches = prefill_batch(ad, prompts, None, torch.device("cpu"))
        for p, lg, c in zip(prompts, logits, caches):
            alone = ad.new_cache(len(p))
            ref = ad.forward(torch.tensor([p]), torch.arange(len(p))[None], alone)
            assert c.lengths == [len(p)] and c.rows == 1
            assert torch.allclose(lg, ref[0], atol=1e-5, rtol=1e-5)
            for a, b in zip(c.layers, alone.layers):
                assert torch.equal(a.positions, b.positions)
                assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("name", ["full", "streaming", "random", "triattention", "alpha"])
@pytest.mark.parametrize("batch_size", [12, 5])
def test_same_records_as_prefills_alone_float32(tiny, stats_path, name, batch_size):
    """Every sequence: the same tokens, finish and meter with prompts prefilled together as one at a
    time (float32; logits to rounding), in fewer prefill forwards."""
    together, st_t = _decode(tiny.model, _policy(name, stats_path), batch_size, True)
    alone, st_a = _decode(tiny.model, _policy(name, stats_path), batch_size, False)
    assert sorted(together) == sorted(alone) == list(range(len(PROMPTS)))
    for i, g in alone.items():
        t = together[i]
        assert t.token_ids == g.token_ids, i
        assert t.finish_reason == g.finish_reason and t.meter.summary() == g.meter.summary()
        scale = float(g.step_logits[0].abs().max().clamp(min=1.0))
        assert all(float((a - b).abs().max()) <= 1e-5 * scale for a, b in zip(t.step_logits, g.step_logits))
    assert st_a.prefill_batches == len(PROMPTS)
    assert st_t.prefill_batches < st_a.prefill_batches
    if batch_size == len(PROMPTS):  # every prompt starts at once: one forward per chunk
        assert st_t.prefill_batches == len(chunks([len(p) for p in PROMPTS])) == 2


def test_float64_records_identical(tiny64, stats_path):
    together, _ = _decode(tiny64, _policy("streaming", stats_path), 12, True)
    alone, _ = _decode(tiny64, _policy("streaming", stats_path), 12, False)
    for i, g in alone.items():
        assert together[i].token_ids == g.token_ids and together[i].meter.summary() == g.meter.summary()


def test_scorers_that_observe_the_forward_prefill_alone(tiny, stats_path):
    """A scorer whose `observe` or recorded queries would see the padding keeps one prompt a forward."""
    batchable = {n for n in available() if get_scorer_class(n).batch_prefill}
    assert batchable == {"full", "streaming", "random", "random-pp", "triattention", "alpha"}
    _, stats = _decode(tiny.model, _policy("snapkv", stats_path), 12, True)
    assert stats.prefill_batches == len(PROMPTS)
