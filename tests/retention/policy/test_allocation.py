"""The allocating routings, PyramidKV and AdaKV (retention.policy.routing, .allocation), and the
ragged rows of the cache they need (retention.runtime.cache): the allocation math, the per-layer
and per-head attention mask, batch invariance, the trivial members, the refusals and a CLI run.
(Conformance with kvpress's outputs: tests/retention/runs/test_conformance_routing.py.)"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from retention.cli import main
from retention.errors import RetentionError
from retention.runs.arms import validate_arm
from retention.runtime.adapter import ModelAdapter
from retention.policy.routing.allocation import adakv_kept, cap_to_stored, pyramid_budgets, safeguard_size
from retention.runtime.cache import Allocation, RetentionCache
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.runtime.meter import BudgetMeter

PROMPTS = [list(range(3 + i, 16 + 8 * i)) for i in range(8)]
ROUTINGS = [{"name": "pyramidkv", "params": {"beta": 20}}, {"name": "adakv", "params": {"alpha": 0.2}}]


def arm(routing, scorer="snapkv", **kw):
    """An arm at budget 20, interval 4 (k = 17). SnapKV with a window of 2: kvpress's pyramid needs
    its bottom layer (`k / beta`, or `2k - (n - window)` once clipped) to hold the window, which a
    window of 8 at k = 17 never allows (PyramidKV then keeps k everywhere, as kvpress does)."""
    params = {"window": 2} if scorer == "snapkv" else {}
    return validate_arm({"model": "tiny-random", "scorer": scorer, "scorer_params": params, "budget": 20,
                         "interval": 4, "routing": routing, **kw})


def decode(model, spec, prompts, batch_size, new=24, keep_logits=False):
    out = {}
    run_engine(model, [Request(i, p, i) for i, p in enumerate(prompts)], spec.policy(),
               SamplingConfig(max_new_tokens=new, ignore_eos=True), set(), 1.0, batch_size=batch_size,
               keep_logits=keep_logits, on_finish=lambda r, g: out.__setitem__(r.key, g))
    return out


# -- the allocation math -----------------------------------------------------------------------


def test_pyramid_budgets_hold_the_mean_and_their_bounds():
    """Whole keep, n and window (as at run time): the budgets sum to L x keep exactly (the float
    slope can break the rounding's symmetry; the residual is moved), stay in [window, n], fall
    with the layer, and beta = 1 is flat."""
    for layers in (1, 2, 3, 4, 9, 24, 28):
        for keep in (1, 2, 14, 17, 47, 125):
            for beta in (1.0, 1.5, 2.0, 20.0):
                for window in (0, 1, 8):
                    if window > keep:
                        continue
                    n = torch.arange(keep + 1, keep + 140, dtype=torch.float64)
                    b = pyramid_budgets(n, torch.full_like(n, keep), layers, beta, torch.full_like(n, window))
                    assert torch.equal(b.sum(0), torch.full_like(b[0], layers * keep)), (layers, keep, beta)
                    assert bool((b >= window).all() and (b <= n.long()).all()) and bool((b.diff(dim=0) <= 0).all())
                    if beta == 1.0:
                        assert bool((b == keep).all())


def test_pyramid_residual_case_is_corrected():
    """9 layers, keep 14, beta 1.5: kvpress's rounding sums to one token short; the budgets here do not."""
    n = torch.tensor([40.0], dtype=torch.float64)
    b = pyramid_budgets(n, torch.tensor([14.0], dtype=torch.float64), 9, 1.5, torch.zeros(1, dtype=torch.float64))
    assert int(b.sum()) == 9 * 14 and b[:, 0].tolist() == sorted(b[:, 0].tolist(), reverse=True)


def test_cap_to_stored_keeps_the_total_within_what_each_layer_stores():
    targets = torch.tensor([[33], [22], [12], [1]])
    stored = torch.tensor([[21], [21], [21], [5]])  # the last layer cannot give what it is owed
    got = cap_to_stored(targets, torch.tensor([[40], [40], [40], [40]]))
    assert torch.equal(got, targets)
    got = cap_to_stored(targets, stored)
    assert int(got.sum()) == 68 and bool((got <= stored).all()) and got[:, 0].tolist() == [21, 21, 21, 5]


def test_adakv_counts_sum_per_layer_and_respect_the_safeguard():
    g = torch.Generator().manual_seed(0)
    L, B, G, n, k = 3, 4, 4, 30, 10
    scores = torch.randn(L, B, G, n, generator=g) * torch.tensor([1.0, 5.0, 0.2, 1.0])[:, None]
    valid = torch.ones(L, B, G, n, dtype=torch.bool)
    valid[:, 1, :, 25:] = False  # a padded row
    protected = torch.zeros_like(valid)
    protected[..., :2] = True  # sinks
    for alpha in (0.0, 0.2, 0.5):
        n_safe = safeguard_size(k, alpha)
        kept, safe = adakv_kept(scores, protected, valid, k, n_safe)
        counts = kept.sum(-1)
        assert bool((counts.sum(-1) == G * k).all()) and bool((counts >= max(n_safe, 2)).all())
        assert not bool((kept & ~valid).any()) and bool((kept | ~protected).all()) and bool((kept | ~safe).all())
    kept, _ = adakv_kept(scores, protected, valid, k, safeguard_size(k, 1.0))
    assert bool((kept.sum(-1) == k).all())  # alpha = 1: the per-head top-k
    assert safeguard_size(24, 0.2) == 4 and safeguard_size(3, 0.1) == 1 and safeguard_size(5, 0.0) == 0


# -- ragged rows in the cache --------------------------------------------------------------------


def ragged_cache(model, prompt_len=30, seed=0):
    """A one-row cache after a prefill, compacted with different counts per (layer, KV head), and
    the next token's ids and position."""
    ad = ModelAdapter(model)
    cache = ad.new_cache(None)
    cache.slots, cache.prompt_lengths = [0], [prompt_len]
    ids = torch.arange(3, 3 + prompt_len)[None]
    with torch.inference_mode():
        ad.forward(ids, torch.arange(prompt_len)[None], cache)
    L, G = len(cache.layers), cache.layers[0].kbuf.shape[1]
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(4, 20, (L, G), generator=g)
    counts[0, 0] = 20  # the widest head
    fix = L * G * 12 - int(counts.sum())  # mean 12
    counts[-1, -1] += fix
    keep = torch.full((L, 1, G, 20), -1)
    for l in range(L):
        for h in range(G):
            c = int(counts[l, h])
            keep[l, 0, h, :c] = torch.sort(torch.randperm(prompt_len, generator=g)[:c]).values
    with torch.inference_mode():
        cache.compact_rows([0], keep, Allocation((20,), 12))
    return ad, cache, counts, torch.tensor([[7]]), torch.tensor([[prompt_len]])


def test_ragged_compaction_stores_the_counts_and_marks_the_holes(tiny):
    _, cache, counts, _, _ = ragged_cache(tiny.model)
    assert cache.ragged and cache.lengths == [12] and cache.widths == [20] and cache.holes == [8]
    held = torch.stack([(ly.pbuf[0, :, :20] >= 0).sum(-1) for ly in cache.layers])
    assert torch.equal(held, counts) and float(held.double().mean()) == cache.lengths[0]
    valid = cache.layer_valid(1)
    assert torch.equal(valid.sum(-1)[0], counts[1])


def test_holes_are_hidden_from_every_layer_and_query_head(tiny, monkeypatch):
    """Garbage written into the holes changes nothing: the mask the model reads is each layer's own
    (GQA: 4 query heads over 2 KV heads), rewritten before each layer's attention. Without that
    rewrite (every layer reading zeros) the same garbage does change the logits."""
    ad, cache, _, ids, pos = ragged_cache(tiny.model)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        spoilt = copy.deepcopy(cache)
        for ly in spoilt.layers:
            hole = (ly.pbuf[:, :, :20] < 0)[..., None]
            for name in ("k", "v"):
                buf = ly.stores[name]
                noise = 50 * torch.randn(buf[:, :, :20].shape, generator=g)
                buf[:, :, :20] = torch.where(hole, noise, buf[:, :, :20])
        clean = ad.forward(ids, pos, copy.deepcopy(cache), padded=True)
        dirty = ad.forward(ids, pos, copy.deepcopy(spoilt), padded=True)
        assert torch.equal(clean, dirty)
        monkeypatch.setattr(RetentionCache, "_layer_mask", lambda self, layer: None)
        unmasked = ad.forward(ids, pos, copy.deepcopy(spoilt), padded=True)
    assert not torch.allclose(clean, unmasked)


def test_a_ragged_cache_refuses_a_forward_without_its_mask(tiny):
    ad, cache, _, ids, pos = ragged_cache(tiny.model)
    cache.set_step_positions(pos)
    with pytest.raises(RuntimeError, match="needs its attention_mask"), torch.inference_mode():
        tiny.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)


def test_load_row_and_select_rows_carry_the_holes(tiny):
    _, src, counts, _, _ = ragged_cache(tiny.model)
    batch = RetentionCache.empty_like(src, 3, 32)
    with torch.inference_mode():
        batch.load_row(2, src)
    assert batch.ragged and batch.lengths == [0, 0, 12] and batch.widths == [0, 0, 20]
    held = torch.stack([(ly.pbuf[2, :, :20] >= 0).sum(-1) for ly in batch.layers])
    assert torch.equal(held, counts)
    with torch.inference_mode():
        batch.select_rows([2])
    assert batch.lengths == [12] and batch.holes == [8]
    assert torch.equal(batch.layers[0].pbuf[0, :, :20], src.layers[0].pbuf[0, :, :20])


# -- in the engine -------------------------------------------------------------------------------


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: r["name"])
def test_allocations_are_batch_invariant_and_hold_the_mean(tiny, tiny64, routing):
    """float64: batch 3 (refills, rows dropped at the end) decodes every sequence exactly as batch
    1 (tokens and meters); float32: the same tokens, logits to 1e-5 of their scale. Every record's
    measured mean is within the budget, and the allocation really gives heads different counts."""
    spec = arm(routing)
    b3 = decode(tiny64, spec, PROMPTS, 3)
    for i, p in enumerate(PROMPTS):
        one = decode(tiny64, spec, [p], 1)[0]
        assert one.token_ids == b3[i].token_ids and one.meter.summary() == b3[i].meter.summary()
        assert b3[i].meter.mean <= 20 and not b3[i].meter.exceeded
    b3 = decode(tiny.model, spec, PROMPTS, 3, keep_logits=True)
    for i in (0, 4, 7):
        one = decode(tiny.model, spec, [PROMPTS[i]], 1, keep_logits=True)[0]
        assert one.token_ids == b3[i].token_ids
        for a, b in zip(one.step_logits, b3[i].step_logits):
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max().clamp(min=1.0))


@pytest.mark.parametrize("routing", ROUTINGS, ids=lambda r: r["name"])
def test_allocations_make_ragged_rows(tiny, routing, monkeypatch):
    """The allocation really gives a row's heads different counts (holes after its compactions)."""
    holes = []
    orig = RetentionCache.compact_rows

    def spy(self, rows, keep, allocation=None):
        orig(self, rows, keep, allocation)
        holes.append(max(self.holes[r] for r in rows))
    widths = []
    orig_record = BudgetMeter.record

    def spy_record(self, lengths, kib=None, buffer=None):
        orig_record(self, lengths, kib, buffer)
        widths.append(buffer)
    monkeypatch.setattr(RetentionCache, "compact_rows", spy)
    monkeypatch.setattr(BudgetMeter, "record", spy_record)
    gen = decode(tiny.model, arm(routing), [PROMPTS[5]], 1)[0]
    assert gen.meter.compactions == len(holes) > 1 and max(holes) > 0 and gen.meter.mean <= 20
    # the padding is metered: the buffer reading is the mean row width, above the stored tokens
    assert len(widths) == gen.meter.steps and None not in widths
    assert gen.meter.mean_buffer == pytest.approx(sum(widths) / len(widths))
    assert gen.meter.mean_buffer > gen.meter.mean
    native = decode(tiny.model, arm("native"), [PROMPTS[5]], 1)[0]
    assert native.meter.mean_buffer == native.meter.mean


@pytest.mark.parametrize(("routing", "params"), [("pyramidkv", {"beta": 1.0}), ("adakv", {"alpha": 1.0})])
def test_trivial_members_decode_exactly_what_native_does(tiny, routing, params):
    """PyramidKV's flat pyramid and AdaKV's full safeguard keep k per head: every compaction takes
    the scorer's own selection, so tokens and meters equal native's bit for bit (batch 4)."""
    base = decode(tiny.model, arm("native"), PROMPTS, 4)
    got = decode(tiny.model, arm({"name": routing, "params": params}), PROMPTS, 4)
    for i in base:
        assert base[i].token_ids == got[i].token_ids and base[i].meter.summary() == got[i].meter.summary()
    moved = decode(tiny.model, arm({"name": routing, "params": {}}), PROMPTS, 4)
    assert any(moved[i].token_ids != base[i].token_ids for i in base)  # a real allocation changes the decode


def test_a_wide_window_leaves_kvpress_pyramid_flat(tiny):
    """kvpress's fallback: with SnapKV's default window 8 at k = 17 no compaction of fewer than
    k + 8 stored tokens admits a pyramid (clipped at n - 8 < k, its bottom would be above its top),
    so on prompts of at most 24 tokens PyramidKV decodes exactly what native does; AdaKV allocates."""
    wide = {"scorer_params": {"window": 8}}
    prompts = [list(range(3, 3 + n)) for n in (14, 18, 22, 24)]
    base = decode(tiny.model, arm("native", **wide), prompts, 4)
    flat = decode(tiny.model, arm("pyramidkv", **wide), prompts, 4)
    ada = decode(tiny.model, arm("adakv", **wide), prompts, 4)
    assert all(base[i].token_ids == flat[i].token_ids for i in base)
    assert any(base[i].token_ids != ada[i].token_ids for i in base)


@pytest.mark.parametrize(("cfg", "message"), [
    ({"scorer": "alpha", "routing": "adakv"}, "scorer 'alpha' selects its own way"),
    ({"scorer": "h2o", "routing": "pyramidkv"}, "scorer 'h2o' selects its own way"),
    ({"scorer": "streaming", "routing": "pyramidkv"}, "needs per-layer scores"),
    ({"model": "tiny-mla", "scorer": "snapkv", "routing": "pyramidkv"}, "latent or shared"),
    ({"scorer": "snapkv", "routing": "adakv", "state": "quant"}, "state 'quant' counts the same tokens"),
    ({"scorer": "triattention", "routing": "adakv", "scorer_params": {"routing": "shared"}}, "allocates per layer"),
    ({"scorer": "snapkv", "routing": {"name": "pyramidkv", "params": {"beta": 0.5}}}, "pyramidkv.beta must be"),
    ({"scorer": "snapkv", "routing": {"name": "adakv", "params": {"alpha": 1.5}}}, "adakv.alpha must be in [0, 1]"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(cfg, message, stats_path):
    cfg = dict(cfg, scorer_params=dict(cfg.get("scorer_params", {}), stats=stats_path)) if cfg["scorer"] in (
        "alpha", "triattention") else cfg
    with pytest.raises(RetentionError) as exc:
        validate_arm({"model": "tiny-random", "budget": 20, **cfg})
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_triattention_follows_an_allocation_per_layer(stats_path):
    """An allocation needs one kept set per layer: triattention scores per layer, recorded as its
    configurations always wrote it (`scorer_params.routing`)."""
    spec = arm("pyramidkv", scorer="triattention", scorer_params={"stats": stats_path})
    assert spec.config["scorer_params"]["routing"] == "per-layer" and spec.build_scorer().per_layer
    assert spec.config["routing"] == {"name": "pyramidkv", "params": {"beta": 20.0}}


def test_cli_run_with_pyramidkv(tmp_path):
    res = CliRunner().invoke(main, ["run", "--model", "tiny-random", "--quiet", "--scorer", "snapkv", "--budget", "24",
                                    "--param", "snapkv.window=2", "--routing", "pyramidkv",
                                    "--param", "pyramidkv.beta=20", "--limit", "2",
                                    "--max-new-tokens", "32", "--temperature", "0", "--ignore-eos",
                                    "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    assert cfg["routing"] == {"name": "pyramidkv", "params": {"beta": 20.0}}
    recs = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:
        assert r["compactions"] > 0 and r["cache_mean_tokens"] <= 24 and not r["budget_exceeded"]
