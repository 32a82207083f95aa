"""`triattention` and `alpha` on MLA latent caches (issue 20, item 4), through the scorers themselves.

On a `CacheView` of the agreed latent layout (per eviction group `g` = layer `g`: `L{g}.c_kv`
`[B, 1, n, r]`, `L{g}.k_rope` `[B, 1, n, d_r]`, QK-norm MLA also `L{g}.inv_rms`; no per-head keys),
built by hand from `tiny-mla` / `tiny-qk-norm-mla` caches in float64, the latent scores equal
`retention.policy.scoring.triattention`'s per-head TriAttention on materialised per-head keys with the
equivalent per-head statistics, to 1e-9; alpha's V-signatures equal those of materialised values;
alpha at lambda = 0 keeps exactly the top-k.

The per-head equivalent: query head `h`'s key is `k_h = [W_UK_h c_j (x inv_rms) ; k_rope_j]`, with
the content dims as bands of frequency 0 (real part the content key, imaginary part 0) and the
RoPE bands as stored. On a latent cache one eviction head serves all `H` query heads, so the
per-head cache that aggregates the same way has ONE KV head of `H` query heads whose key is the
concatenation of the `k_h`, query head `h`'s statistics being zero outside its own block (a zero
block adds exactly 0 to both of TriAttention's terms).
"""

from __future__ import annotations

import pytest
import torch

from retention.models.arch.model import build_arch
from retention.runtime.cache import CacheView
from retention.policy.scoring.calibration import QueryStats
from retention.policy.scoring.calibration_latent import calibrate_latent, latent_model
from retention.policy.registry import make_scorer
from retention.policy.scoring.alpha import facility_location_keep
from retention.policy.scoring.frequency import zscore_group_max
from retention.policy.scoring.latent import latent_value_signatures
from retention.policy.scoring.triattention import head_scores, query_weights, rope_inverted_head_scores

TOL = 1e-9
LENGTHS = (20, 24)  # prompt length of each row; a row's next query position
N = 14  # tokens each row of the view holds (a subset: as after evictions)


def _prefill(model, length: int, seed: int):
    ids = torch.randint(0, 259, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, torch.arange(length)[None], cache)
    return cache


def latent_view(model, seed: int = 0, same_position: bool = False) -> CacheView:
    """Two rows of different prompts, each holding `N` of its tokens (the first, the last two and a
    random rest, as after evictions), as the one runtime's cache presents a latent layout."""
    L = model.config.layers
    g = torch.Generator().manual_seed(seed)
    lengths = (LENGTHS[0], LENGTHS[0]) if same_position else LENGTHS
    stores = [dict() for _ in range(L)]
    rows = []
    for r, length in enumerate(lengths):
        cache = _prefill(model, length, seed + r)
        keep = torch.cat([torch.tensor([0]), 1 + torch.randperm(length - 3, generator=g)[:N - 3].sort().values,
                          torch.tensor([length - 2, length - 1])])
        rows.append((cache, keep))
    for layer in range(L):
        for name in [s.name for s in model.config.cache_layout().stores if s.name.startswith(f"L{layer}.")]:
            stores[layer][name] = torch.cat([c.read(name)[:, :, keep] for c, keep in rows])
    pos = torch.stack([keep for _, keep in rows])[:, None]  # [B, 1, n]
    protected = torch.zeros_like(pos, dtype=torch.bool)
    protected[..., 0] = True
    protected[..., -2:] = True
    # alpha's per-token signatures, as `alpha.observe` writes them (its own test: below).
    w_uv = [latent_model(model).up_weights(i)[1] for i in range(L)]
    sig = latent_value_signatures([stores[i][f"L{i}.c_kv"][:, 0] for i in range(L)], w_uv)[:, None]
    return CacheView([], [], [pos] * L, [protected] * L, torch.tensor(lengths), extra=[{"alpha_sig": sig}] * L,
                     stores=stores, groups=[(layer,) for layer in range(L)], layout=model.config.cache_layout())


@pytest.fixture(scope="module", params=["tiny-mla", "tiny-qk-norm-mla"])
def setup(request):
    """(model float64, latent model, latent statistics calibrated on 200 tokens)."""
    model = build_arch(request.param, dtype=torch.float64)
    ids = torch.randint(0, 259, (200,), generator=torch.Generator().manual_seed(9))
    stats = calibrate_latent(model, ids, chunk=64, model_id=request.param)
    return model, latent_model(model), stats


def _bound(name: str, model, latent, stats, structure: str = "shared", **params):
    scorer = make_scorer(name, **params).structured(structure)
    scorer.bind_latent(stats, latent)
    return scorer


def materialised(view: CacheView, latent, stats):
    """The per-head equivalent (module doc): keys `L x [B, 1, n, D]` half-split (bands first, then
    their imaginary parts), `QueryStats` `[L, H, F_all]`, inv_freq `[F_all]`, all float64."""
    H, dn, F = latent.q_heads, latent.nope_dim, latent.rope_dim // 2
    keys = []
    for layer in range(len(view.stores)):
        st = view.stores[layer]
        c, kr = st[f"L{layer}.c_kv"][:, 0], st[f"L{layer}.k_rope"][:, 0]
        w_uk_t, _ = latent.up_weights(layer)
        k_nope = torch.einsum("bnr,hre->bhne", c, w_uk_t.double())  # [B, H, n, d_nope]
        if f"L{layer}.inv_rms" in st:
            rho = st[f"L{layer}.inv_rms"][..., 0]  # [B, G, n]
            k_nope = k_nope * rho.repeat_interleave(H // rho.shape[1], dim=1)[..., None]
        re, im = kr[..., 0::2], kr[..., 1::2]  # tiny models: interleaved RoPE pairs
        band_re = torch.cat([k_nope, re[:, None].expand(-1, H, -1, -1)], -1)  # [B, H, n, dn + F]
        band_im = torch.cat([torch.zeros_like(k_nope), im[:, None].expand(-1, H, -1, -1)], -1)
        # One KV head: the H blocks side by side, real parts first (`head_scores`' band layout).
        keys.append(torch.cat([band_re.permute(0, 2, 1, 3).flatten(2), band_im.permute(0, 2, 1, 3).flatten(2)],
                              -1)[:, None])
    Lq = stats.rope_qm.shape[0]
    per_head = torch.cat([torch.complex(stats.content_mean.double(), torch.zeros_like(stats.content_mean.double())),
                          stats.rope_qm.to(torch.complex128)], -1)  # [L, H, dn + F]
    per_head_qa = torch.cat([stats.content_mean.double().abs(), stats.rope_qa.double()], -1)
    qm = torch.zeros(Lq, H, H, dn + F, dtype=torch.complex128)
    qa = torch.zeros(Lq, H, H, dn + F, dtype=torch.float64)
    for h in range(H):  # query head h reads only its own block
        qm[:, h, h], qa[:, h, h] = per_head[:, h], per_head_qa[:, h]
    inv = torch.cat([torch.zeros(dn, dtype=torch.float64), latent.inv_freq.double()]).repeat(H)
    return keys, QueryStats(qm.flatten(2), qa.flatten(2), inv, {}), inv


def per_head_reference(view: CacheView, keys, qs: QueryStats, inv) -> torch.Tensor:
    """triattention's per-head score (shared routing) in float64, row by row: the scorer's own
    `query_weights` / `head_scores` / `zscore_group_max`, and the raw scores also the long way."""
    rows = []
    for b, t in enumerate(view.next_position.tolist()):
        trig, norm = query_weights(qs.qm, qs.qa, inv, t, 1, dtype=torch.float64)
        total = 0
        for layer, k in enumerate(keys):
            raw = head_scores(k[b:b + 1], trig[layer], norm[layer])  # [1, 1, H, n]
            long_way = rope_inverted_head_scores(k[b:b + 1], view.positions[layer][b:b + 1], qs.qm[layer],
                                                 qs.qa[layer], inv, t)
            assert (raw - long_way).abs().max() <= 1e-9 * long_way.abs().max()
            valid = view.valid[layer][b:b + 1]
            total = total + zscore_group_max(raw, ~view.protected[layer][b:b + 1] & valid)
        rows.append(total / len(keys))
    return torch.cat(rows)


@pytest.mark.parametrize("same_position", [False, True])
def test_latent_triattention_equals_per_head_on_materialised_keys(setup, same_position):
    model, latent, stats = setup
    view = latent_view(model, same_position=same_position)
    assert view.keys == [] and view.stores[0]["L0.c_kv"].dtype == torch.float64
    got = _bound("triattention", model, latent, stats).score(view)
    keys, qs, inv = materialised(view, latent, stats)
    want = per_head_reference(view, keys, qs, inv)
    assert got.shape == want.shape == (2, 1, N) and got.dtype == torch.float64
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < TOL, err
    # The per-head scorer itself (it scores in float32) on the materialised cache: same scores to
    # float32 precision, same kept sets.
    head = make_scorer("triattention")
    head.bind(qs, inv.float())
    per_head_view = CacheView(keys, keys, view.positions, view.protected, view.next_position)
    hs = head.score(per_head_view)
    assert (hs.double() - want).abs().max() < 1e-4
    for k in (4, 8, 11):
        assert torch.equal(head.select(hs, per_head_view, k), _bound("triattention", model, latent, stats)
                           .select(got, view, k))
    # Not vacuous: other statistics (another layer's) give other scores.
    shifted = type(stats)(stats.rope_qm.roll(1, 0), stats.rope_qa.roll(1, 0), stats.content_mean.roll(1, 0),
                          stats.content_qa, stats.inv_freq, stats.meta)
    assert (_bound("triattention", model, latent, shifted).score(view) - got).abs().max() > 1e-2


def test_per_layer_routing_on_a_latent(setup):
    model, latent, stats = setup
    view = latent_view(model)
    shared = _bound("triattention", model, latent, stats).score(view)
    per_layer = _bound("triattention", model, latent, stats, "per-layer").score(view)
    assert per_layer.shape == (model.config.layers, 2, 1, N)
    torch.testing.assert_close(per_layer.mean(0), shared, rtol=0, atol=1e-12)
    keep = _bound("triattention", model, latent, stats, "per-layer").select(per_layer, view, 6)
    assert keep.shape == (model.config.layers, 2, 1, 6)
    assert bool(keep[..., 0].eq(0).all())  # the protected sink is kept in every layer


def _materialised_signatures(model, latents) -> torch.Tensor:
    """`[B, n, d_v]`: every head's value `W_UV_h c_j` materialised in every layer, averaged, normalised."""
    values = []
    for layer, c in enumerate(latents):
        attn = model.model.layers[layer].self_attn
        w_uv = (attn.v_b_proj.weight.view(model.config.q_heads, model.config.v_dim, -1)
                if model.config.family == "qk-norm-mla" else attn.up_weights()[1])
        values.append(torch.einsum("bnr,hvr->bhnv", c, w_uv))
    return torch.nn.functional.normalize(torch.stack(values).mean(dim=(0, 2)), dim=-1)


@pytest.mark.parametrize("routing", ["shared", "per-layer"])
def test_alpha_writes_latent_signatures_that_follow_compactions(setup, routing):
    """On the one runtime's layout cache: `observe` writes each new token's signature from its
    latents (equal to materialised values' to 1e-9), and after a compaction (per-layer routing:
    another kept set in each layer) every group still holds its kept tokens' signatures of the
    time they were written, though other layers dropped those tokens' latents."""
    model, latent, stats = setup
    L = model.config.layers
    alpha = _bound("alpha", model, latent, stats, routing)
    ids = torch.randint(0, 259, (1, 18), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache()
    with torch.no_grad():
        model(ids[:, :15], torch.arange(15)[None], cache)
        alpha.observe(cache, [15])
        for t in (15, 16):  # two decode steps
            model(ids[:, t:t + 1], torch.tensor([[t]]), cache)
            alpha.observe(cache, [t + 1])
    latents = [cache.read(f"L{i}.c_kv")[:, 0] for i in range(L)]
    want = _materialised_signatures(model, latents)  # [1, 17, d_v], at write time
    view = cache.view(17)
    groups = range(L) if routing == "per-layer" else (0,)
    for g in groups:
        got = view.extra[g]["alpha_sig"]
        assert got.shape == (1, 1, 17, model.config.v_dim) and got.dtype == torch.float64
        err = (got[:, 0] - want).abs().max().item()
        assert err < TOL, err
    # Compact: keep 9 tokens, another set in each layer with the per-layer routing.
    g = torch.Generator().manual_seed(1)
    sets = [torch.cat([torch.tensor([0]), 1 + torch.randperm(16, generator=g)[:8].sort().values]) for _ in range(L)]
    keep = torch.stack(sets)[:, None, None] if routing == "per-layer" else sets[0][None, None]
    cache.compact_rows([0], keep)
    with torch.no_grad():
        model(ids[:, 17:18], torch.tensor([[17]]), cache)
        alpha.observe(cache, [18])
    new = _materialised_signatures(model, [cache.read(f"L{i}.c_kv")[:, 0, -1:] for i in range(L)])  # the new token
    view = cache.view(18)
    for g_ in groups:
        kept = sets[g_] if routing == "per-layer" else sets[0]
        expect = torch.cat([want[:, kept], new], 1)
        assert (view.extra[g_]["alpha_sig"][:, 0] - expect).abs().max().item() < TOL
    if routing == "per-layer":  # not vacuous: the layers' kept sets differ, and so would their signatures
        assert not torch.equal(sets[0], sets[1])
    scores = alpha.score(view)
    kept = alpha.select(scores, view, 6)
    assert kept.shape == ((L, 1, 1, 6) if routing == "per-layer" else (1, 1, 6))


def test_alpha_selection_reads_the_signatures(setup):
    model, latent, stats = setup
    view = latent_view(model)
    sig = view.extra[0]["alpha_sig"]
    want = _materialised_signatures(model, [view.stores[i][f"L{i}.c_kv"][:, 0] for i in range(model.config.layers)])
    assert (sig[:, 0] - want).abs().max().item() < TOL
    scores = _bound("triattention", model, latent, stats).score(view)
    a = _bound("alpha", model, latent, stats, lam=0.7)
    assert torch.equal(a.select(scores, view, 8), facility_location_keep(scores, want[:, None], view.protected[0], 8,
                                                                        0.7))
    big = _bound("alpha", model, latent, stats, lam=50.0).select(scores, view, 8)
    assert not torch.equal(big, _bound("alpha", model, latent, stats, lam=0.0).select(scores, view, 8))


@pytest.mark.parametrize("k", [3, 5, 8, 12, N])
def test_alpha_lambda_zero_is_latent_topk(setup, k):
    model, latent, stats = setup
    for seed, same in ((0, False), (1, True)):
        view = latent_view(model, seed, same)
        tri = _bound("triattention", model, latent, stats)
        scores = tri.score(view)
        got = _bound("alpha", model, latent, stats, lam=0.0).select(scores, view, k)
        assert torch.equal(got, tri.select(scores, view, k))
        assert got.shape == (2, 1, k) and bool(got[..., 0].eq(0).all())


def test_scorers_declare_both_reads():
    for name in ("triattention", "alpha"):
        reads = make_scorer(name).reads
        assert frozenset({"latent", "calibration"}) in reads and any("keys" in r for r in reads)


def test_attach_binds_latent_statistics_and_refuses_what_is_not_derived(tmp_path):
    from retention.errors import RetentionError

    model = build_arch("tiny-mla")
    stats = calibrate_latent(model, torch.arange(64) % 259, model_id="tiny-mla")
    path = stats.save(tmp_path / "mla.safetensors")
    scorer = make_scorer("alpha", stats=str(path))
    with scorer.attach(model):
        view = latent_view(model)
        keep = scorer.select(scorer.score(view), view, 6)
    assert keep.shape == (2, 1, 6)
    with pytest.raises(RetentionError, match="path-on-MLA"):
        with make_scorer("triattention", stats=str(path)).attach(build_arch("tiny-path-mla")):
            pass


def test_scores_on_the_one_runtimes_padded_view_are_per_row(setup):
    """A view of the one runtime's cache with rows of different lengths (the shorter padded): each
    row's latent scores equal the per-head reference on that row, and those of the row alone (the
    padding changes nothing: batch invariance)."""
    from retention.runtime.cache import RetentionCache

    model, latent, stats = setup
    prefills = [_prefill(model, n, seed) for n, seed in ((20, 0), (26, 1))]
    cache = RetentionCache.empty_like(prefills[0], rows=2, capacity=32)
    for row, p in enumerate(prefills):
        cache.load_row(row, p)
    view = cache.view([20, 26], sink=1, recent=3)
    assert not bool(view.valid[0][0, 0, 20:].any()) and bool(view.valid[0][1].all())
    scorer = _bound("triattention", model, latent, stats)
    got = scorer.score(view)  # [2, 1, 26]
    assert bool(torch.isinf(got[0, 0, 20:]).all())
    keys, qs, inv = materialised(view, latent, stats)
    want = per_head_reference(view, keys, qs, inv)
    ok = view.valid[0] & ~view.protected[0]
    assert (got - want)[ok].abs().max().item() < TOL * want[ok].abs().max().item()
    keep = scorer.select(got, view, 9)
    for row, (p, n) in enumerate(zip(prefills, (20, 26))):
        alone = p.view(n, sink=1, recent=3)
        single = scorer.score(alone)
        # equal to rounding (reductions over a padded row may round differently), same kept set
        assert (single[0, 0] - got[row, 0, :n]).abs().max().item() < 1e-12
        assert torch.equal(scorer.select(single, alone, 9)[0], keep[row])
