"""Each scorer against a naive reference written from docs/scorers.md: plain Python loops, float64.

Random tensors with GQA (3 query heads per KV head), odd sizes, batch 2, and per-head positions
that differ between KV heads (as they do after a compaction).
"""

import cmath
import math
from types import SimpleNamespace

import pytest
import torch

from retention.runtime.cache import CacheView
from retention.policy.scoring.calibration import QueryStats
from retention.policy.registry import make_scorer
from retention.policy.scoring.h2o import attention_mass
from retention.policy.scoring.triattention import OFFSETS, head_scores, query_weights, rope_inverted_head_scores

L, B, G, R, N, D = 3, 2, 2, 3, 13, 10  # layers, batch, KV heads, group, stored tokens, head dim
HQ, F = G * R, D // 2
T = 3001  # next query position
INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def make_positions(gen, same_layers=True, n=N, t=T):
    """Ascending distinct positions `[B, G, n]` per head (the newest 8 = the last 8 positions)."""
    def one():
        out = torch.empty(B, G, n, dtype=torch.long)
        for b in range(B):
            for g in range(G):
                old = torch.randperm(t - 8, generator=gen)[: n - 8].sort().values
                out[b, g] = torch.cat([old, torch.arange(t - 8, t)])
        return out

    first = one()
    return [first.clone() if same_layers else one() for _ in range(L)]


def make_view(seed=0, same_layers=True, protect_first=0, recent=0):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(B, G, N, D, generator=gen) for _ in range(L)]
    values = [torch.randn(B, G, N, D, generator=gen) for _ in range(L)]
    positions = make_positions(gen, same_layers)
    protected = [(p < protect_first) | (p >= T - recent) for p in positions]
    return CacheView(keys, values, positions, protected, T)


def make_stats(seed=1):
    gen = torch.Generator().manual_seed(seed)
    qm = torch.complex(torch.randn(L, HQ, F, generator=gen), torch.randn(L, HQ, F, generator=gen))
    qa = qm.abs() + torch.rand(L, HQ, F, generator=gen)  # E|q| >= |E q|, as for real statistics
    return QueryStats(qm, qa, INV_FREQ.float(), {})


# --------------------------------------------------------------------------------------------
# TriAttention
# --------------------------------------------------------------------------------------------


def ref_tri_raw(key, qm_h, qa_h, t):
    """s(l,h,j) for one key `[D]` and one query head's statistics `[F]`, straight from the spec."""
    k = [complex(float(key[f]), float(key[f + F])) for f in range(F)]
    trig = 0.0
    for d in OFFSETS:
        acc = 0.0
        for f in range(F):
            a = complex(qm_h[f]) * k[f].conjugate()
            acc += (a * cmath.exp(1j * float(INV_FREQ[f]) * (t + d))).real
        trig += acc / len(OFFSETS)
    norm = sum((float(qa_h[f]) - abs(complex(qm_h[f]))) * abs(k[f]) for f in range(F))
    return trig + norm


def ref_tri_scores(view, stats, per_layer):
    """Reference aggregation: z-score per (l, b, h) over candidates, max over group, mean over layers."""
    out = [[[[0.0] * N for _ in range(G)] for _ in range(B)] for _ in range(L)]
    for l in range(L):
        for b in range(B):
            for g in range(G):
                cand = [j for j in range(N) if not bool(view.protected[l][b, g, j])]
                best = [-math.inf] * N
                for h in range(g * R, (g + 1) * R):
                    raw = [ref_tri_raw(view.keys[l][b, g, j], stats.qm[l, h], stats.qa[l, h], T) for j in range(N)]
                    mu = sum(raw[j] for j in cand) / len(cand)
                    sd = math.sqrt(sum((raw[j] - mu) ** 2 for j in cand) / len(cand))
                    sd = max(sd, 1e-6)
                    best = [max(best[j], (raw[j] - mu) / sd) for j in range(N)]
                out[l][b][g] = best
    t = torch.tensor(out, dtype=torch.float64)
    return t if per_layer else t.mean(0)


@pytest.mark.parametrize("routing", ["shared", "per-layer"])
def test_triattention_matches_reference(routing):
    view = make_view(seed=0, same_layers=(routing == "shared"), protect_first=200, recent=2)
    stats = make_stats()
    sc = make_scorer("triattention").structured(routing)
    sc.bind(stats, stats.inv_freq)
    got = sc.score(view)
    want = ref_tri_scores(view, stats, per_layer=(routing == "per-layer"))
    assert sc.per_layer == (routing == "per-layer")
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    keep = sc.select(got, view, 7)
    assert keep.shape == (*want.shape[:-1], 7)
    # protected tokens are always kept
    prot = torch.stack(view.protected) if sc.per_layer else view.protected[0]
    assert bool(torch.gather(prot, -1, keep).sum() == prot.sum())


def rope(x, pos):
    """transformers' RoPE (rotate_half convention) at positions `pos` (`[..., n]`), float64."""
    ang = pos.double()[..., None] * INV_FREQ  # [..., n, F]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    rot = torch.cat([-x[..., F:], x[..., :F]], -1)
    return x * cos + rot * sin


def test_trig_form_equals_rope_inverted_form():
    gen = torch.Generator().manual_seed(3)
    pre = torch.randn(B, G, N, D, generator=gen, dtype=torch.float64)
    pos = make_positions(gen, n=N, t=T)[0]
    post = rope(pre, pos)
    stats = make_stats(seed=4)
    for l in range(L):
        trig_w, norm_w = query_weights(stats.qm, stats.qa, INV_FREQ, T, G)
        fast = head_scores(post.float(), trig_w[l], norm_w[l])  # no inversion, float32
        slow = rope_inverted_head_scores(post, pos, stats.qm[l], stats.qa[l], INV_FREQ, T)  # float64
        torch.testing.assert_close(fast.double(), slow, rtol=1e-4, atol=1e-4)
        # Meaning of the trig term: the mean over D of the real attention logit of the mean query
        # (vector [Re Qm, Im Qm]) rotated to position t + d, against the stored post-RoPE key.
        qvec = torch.cat([stats.qm[l].real, stats.qm[l].imag], -1).double()  # [Hq, D]
        qpos = (T + torch.tensor(OFFSETS, dtype=torch.float64))[None].expand(HQ, -1)
        qrot = rope(qvec[:, None, :].expand(HQ, len(OFFSETS), D), qpos)  # [Hq, |D|, D]
        logits = torch.einsum("grod,bgnd->bgrn", qrot.reshape(G, R, -1, D), post) / len(OFFSETS)
        kmod = torch.hypot(pre[..., :F], pre[..., F:])  # |k_f| of the pre-RoPE keys
        w_norm = (stats.qa[l].double() - stats.qm[l].to(torch.complex128).abs()).reshape(G, R, F)
        torch.testing.assert_close(slow, logits + torch.einsum("grf,bgnf->bgrn", w_norm, kmod))


# --------------------------------------------------------------------------------------------
# SnapKV and R-KV
# --------------------------------------------------------------------------------------------

W, SCALE = 8, 0.37


def make_queries(seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, HQ, W, D, generator=gen) for _ in range(L)]


def ref_importance(q, keys, cand_idx):
    """SnapKV importance of one (b, g): list over candidate slots, after the max-pool."""
    w = q.shape[1]
    n_c = len(cand_idx)
    mean = [0.0] * n_c
    for i in range(w):
        logits = []
        for j in cand_idx:
            logits.append(max(float(q[h, i].double() @ keys[j].double()) for h in range(q.shape[0])) * SCALE)
        m = max(logits)
        e = [math.exp(x - m) for x in logits]
        s = sum(e)
        for c in range(n_c):
            mean[c] += e[c] / s / w
    return [max(mean[max(0, c - 3):c + 4]) for c in range(n_c)]  # kernel 7, stride 1, same padding


def ref_redundancy(keys, thr=0.5):
    """R-KV redundancy over all n stored slots (window included), plain Python float64, as the
    golden README states the reference: k / (|k| + 1e-8), diagonal 0, zero each row's largest
    partner slot (slot 0 when it has none), column mean over n rows, softmax over n."""
    n = keys.shape[0]
    kn = [keys[j].double() / (float(keys[j].double().norm()) + 1e-8) for j in range(n)]
    S = [[0.0 if a == c else float(kn[a] @ kn[c]) for c in range(n)] for a in range(n)]
    for a in range(n):
        dups = [c for c in range(n) if c != a and S[a][c] > thr]
        S[a][max(dups) if dups else 0] = 0.0
    col = [sum(S[a][c] for a in range(n)) / n for c in range(n)]
    m = max(col)
    e = [math.exp(x - m) for x in col]
    return [x / sum(e) for x in e]


def ref_window_scores(view, queries, lam=None):
    out = torch.zeros(L, B, G, N, dtype=torch.float64)
    for l in range(L):
        for b in range(B):
            for g in range(G):
                pos = view.positions[l][b, g]
                cand = [j for j in range(N) if int(pos[j]) < T - W]
                q = queries[l][b, g * R:(g + 1) * R]
                imp = ref_importance(q, view.keys[l][b, g], cand)
                if lam is not None:
                    red_all = ref_redundancy(view.keys[l][b, g])
                    red = [red_all[j] for j in cand]
                    imp = [lam * x - (1 - lam) * y for x, y in zip(imp, red)]
                for c, j in enumerate(cand):
                    out[l, b, g, j] = imp[c]
                for j in range(N):
                    if int(pos[j]) >= T - W:
                        out[l, b, g, j] = math.inf
    return out


def near_duplicate_keys(view, seed=7):
    """Make some keys near-copies of others (so the R-KV duplicate rule has work to do)."""
    gen = torch.Generator().manual_seed(seed)
    for k in view.keys:
        k[:, :, 3] = k[:, :, 1] + 0.05 * torch.randn(B, G, D, generator=gen)
        k[:, :, 4] = k[:, :, 1] + 0.05 * torch.randn(B, G, D, generator=gen)
        k[:, :, 0] = 2.0 * k[:, :, 2]


def test_snapkv_matches_reference():
    view = make_view(seed=8, same_layers=False)
    queries = make_queries()
    sc = make_scorer("snapkv")
    sc._queries, sc._scaling = queries, SCALE
    got = sc.score(view)
    want = ref_window_scores(view, queries)
    assert sc.per_layer and got.shape == (L, B, G, N)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_rkv_matches_reference():
    view = make_view(seed=9, same_layers=False)
    near_duplicate_keys(view)
    queries = make_queries(seed=10)
    sc = make_scorer("rkv")
    sc._queries, sc._scaling = queries, SCALE
    got = sc.score(view)
    want = ref_window_scores(view, queries, lam=0.1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_rkv_keeps_the_newest_of_near_duplicates():
    """Three near-identical keys: the newest (largest slot) is everybody's most recent duplicate, so
    its column loses their similarity and it scores as the least redundant of the three."""
    from retention.policy.scoring.rkv import key_redundancy

    gen = torch.Generator().manual_seed(11)
    keys = torch.randn(1, 1, 9, 16, generator=gen)
    base = torch.randn(16, generator=gen)
    for j in (2, 5, 7):
        keys[0, 0, j] = base + 0.01 * torch.randn(16, generator=gen)
    red = key_redundancy(keys, torch.ones(1, 1, 9, dtype=torch.bool))[0, 0]
    assert red[7] < red[2] and red[7] < red[5]
    torch.testing.assert_close(red.sum(), torch.tensor(1.0))


def test_snapkv_observe_keeps_the_last_window_of_queries():
    sc = make_scorer("snapkv", window=4)
    gen = torch.Generator().manual_seed(12)
    steps = [torch.randn(1, HQ, q, D, generator=gen) for q in (6, 1, 1, 1)]
    layer = SimpleNamespace(keys=torch.zeros(1))
    for q in steps:
        sc._recorder = SimpleNamespace(take=lambda cache, q=q: [SimpleNamespace(query=q, scaling=0.5)] * 2)
        sc.observe(SimpleNamespace(layers=[layer, layer]), 0)
    want = torch.cat(steps, dim=2)[:, :, -4:]
    assert all(torch.equal(q, want) for q in sc._queries) and sc._scaling == 0.5


# --------------------------------------------------------------------------------------------
# H2O
# --------------------------------------------------------------------------------------------


def ref_mass(query, keys, key_pos, query_pos, scaling):
    Bq, Hq, q, _ = query.shape
    g_n = keys.shape[1]
    out = torch.zeros(Bq, g_n, keys.shape[2], dtype=torch.float64)
    for b in range(Bq):
        for h in range(Hq):
            g = h // (Hq // g_n)
            for i in range(q):
                vis = [j for j in range(keys.shape[2]) if int(key_pos[b, g, j]) <= int(query_pos[b, i])]
                logits = [float(query[b, h, i].double() @ keys[b, g, j].double()) * scaling for j in vis]
                m = max(logits)
                e = [math.exp(x - m) for x in logits]
                for j, x in zip(vis, e):
                    out[b, g, j] += x / sum(e)
    return out


def test_h2o_attention_mass_matches_reference():
    gen = torch.Generator().manual_seed(13)
    keys = torch.randn(B, G, N, D, generator=gen)
    kpos = make_positions(gen)[0]
    query = torch.randn(B, HQ, 5, D, generator=gen)
    qpos = kpos[:, 0, -5:]  # the newest five tokens, causal among themselves
    got = attention_mass(query, keys, kpos, qpos, SCALE)
    torch.testing.assert_close(got.double(), ref_mass(query, keys, kpos, qpos, SCALE), rtol=1e-5, atol=1e-6)


def test_h2o_accumulator_follows_compaction():
    """Accumulated mass per token == the sum of the mass it received at every step while stored,
    tracked independently by absolute position, across a per-layer compaction. (The accumulator
    lives in the cache as per-token state, so the compaction moves it with the keys.)"""
    from retention.runtime.cache import RetentionCache

    gen = torch.Generator().manual_seed(14)
    sc = make_scorer("h2o", window=2)
    n_layers = 2
    cache = RetentionCache(n_layers)
    ref = [dict() for _ in range(n_layers)]  # (g, position) -> mass

    def step(first_pos, q_len):
        new = torch.arange(first_pos, first_pos + q_len)
        cache.set_step_positions(new[None])
        calls = []
        for l in range(n_layers):
            keys, _ = cache.update(torch.randn(1, G, q_len, D, generator=gen), torch.zeros(1, G, q_len, D), l)
            query = torch.randn(1, HQ, q_len, D, generator=gen)
            calls.append(SimpleNamespace(query=query, scaling=SCALE))
        sc._recorder = SimpleNamespace(take=lambda c: calls)
        sc.observe(cache, [first_pos + q_len])
        for l in range(n_layers):
            layer = cache.layers[l]
            m = ref_mass(calls[l].query, layer.keys, layer.positions, new[None], SCALE)
            for g in range(G):
                for j in range(layer.positions.shape[-1]):
                    key = (g, int(layer.positions[0, g, j]))
                    ref[l][key] = ref[l].get(key, 0.0) + float(m[0, g, j])

    step(0, 7)
    step(7, 1)
    keep = torch.stack([torch.tensor([[[0, 2, 5, 7], [1, 3, 6, 7]]]), torch.tensor([[[1, 2, 3, 7], [0, 4, 5, 6]]])])
    cache.compact(keep)
    step(8, 1)
    step(9, 1)
    view = cache.view(10)
    for l in range(n_layers):
        got = view.extra[l][sc.EXTRA]
        want = torch.tensor([[[ref[l][(g, int(p))] for p in view.positions[l][0, g]] for g in range(G)]],
                            dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    keep = sc.select(sc.score(view), view, 5)
    assert bool((keep[..., -2:] == torch.tensor([4, 5])).all())  # window=2: the two newest slots kept


def test_h2o_splits_the_budget_evenly_by_default():
    """Default H2O: k - k//2 newest tokens plus the k//2 heaviest of the rest (the reference split),
    whatever the accumulated mass of the recent ones."""
    from retention.policy.scoring.h2o import heavy_recent_keep, recent_mask

    sc = make_scorer("h2o")
    assert sc.window is None and sc.min_recent() == 0
    n = 12
    mass = torch.arange(n, 0, -1, dtype=torch.float32).expand(1, 1, 1, n).clone()  # older = heavier
    pos = torch.arange(n).expand(1, 1, n)
    view = CacheView([torch.zeros(1, 1, n, 1)], [torch.zeros(1, 1, n, 1)], [pos], [torch.zeros(1, 1, n, dtype=torch.bool)], n,
                     extra=[{sc.EXTRA: mass[0]}])
    assert sc.select(sc.score(view), view, 7)[0, 0, 0].tolist() == [0, 1, 2, 8, 9, 10, 11]  # 3 heavy + 4 recent
    assert sc.select(sc.score(view), view, 6)[0, 0, 0].tolist() == [0, 1, 2, 9, 10, 11]
    # padding (invalid slots after the stored ones) is neither recent nor kept
    valid = torch.ones(1, n, dtype=torch.bool)
    valid[0, -3:] = False
    assert recent_mask(valid, 2)[0].nonzero().flatten().tolist() == [7, 8]
    keep = heavy_recent_keep(mass[0, 0], valid, torch.zeros_like(valid), 2, 2)
    assert keep[0].tolist() == [0, 1, 7, 8]
