"""alpha: V-signatures, the greedy facility-location selector, and lambda = 0 == top-k bit for bit."""

import math
from dataclasses import dataclass, field

import pytest
import torch

from retention.policy.cadence.base import Cadence
from retention.policy.scoring.calibration import calibrate
from retention.runtime.generate import SamplingConfig, generate
from retention.policy.composite import RetentionPolicy
from retention.policy.registry import make_scorer
from retention.policy.scoring.base import topk_keep
from retention.policy.scoring.alpha import facility_location_keep, token_signatures

L, B, G, N, D = 3, 2, 2, 11, 6


def ref_token_signature(values, b, j):
    """Mean of token j's value vectors over every layer and KV head, L2-normalised, float64."""
    m = sum(v[b, g, j].double() for v in values for g in range(v.shape[1])) / (len(values) * values[0].shape[1])
    return m / m.norm()


def test_token_signature_is_the_mean_over_all_layers_and_heads():
    gen = torch.Generator().manual_seed(2)
    values = [torch.randn(B, G, N, D, generator=gen) for _ in range(L)]
    u = token_signatures(values)
    assert u.shape == (B, N, D)
    for b in range(B):
        for j in range(N):
            torch.testing.assert_close(u[b, j].double(), ref_token_signature(values, b, j), rtol=1e-5, atol=1e-6)


def _signatures(cache, sc):
    """`[L', S, G, w, d]` signatures the cache holds for alpha (L' = 1 with shared routing)."""
    layers = cache.layers if sc.per_layer else cache.layers[:1]
    w = cache.layers[0].keys.shape[2]
    return torch.stack([ly.extra[sc.EXTRA][:, :, :w] for ly in layers])


@pytest.mark.parametrize("routing", ["shared", "per-layer"])
def test_signature_follows_its_token_through_any_compactions(routing):
    """Write tokens in bursts into a real retention cache, evict random (different per head, per
    layer) sets in between: every stored slot's signature stays the one its token got when it was
    written, bit for bit."""
    from retention.runtime.cache import RetentionCache

    gen = torch.Generator().manual_seed(9)
    sc = make_scorer("alpha").structured(routing)
    cache = RetentionCache(L)
    written = {}  # (b, position) -> signature at write time
    nxt = 0
    for burst in (7, 1, 3, 1, 1, 5, 1):
        values = [torch.randn(B, G, burst, D, generator=gen) for _ in range(L)]
        cache.set_step_positions(torch.arange(nxt, nxt + burst).expand(B, -1))
        for layer, v in enumerate(values):
            cache.update(torch.randn(B, G, burst, D, generator=gen), v, layer)
        sc.observe(cache, nxt + burst)
        u = token_signatures(values)
        for b in range(B):
            for j in range(burst):
                written[(b, nxt + j)] = u[b, j].clone()
        nxt += burst
        n = cache.lengths[0]
        if n > 4:  # evict to a random 4..n-1 slots, independently per (layer,) batch row and head
            k = int(torch.randint(4, n, (1,), generator=gen))
            shape = (L, B, G, n) if sc.per_layer else (B, G, n)
            cache.compact(torch.rand(*shape, generator=gen).argsort(-1)[..., :k].sort(-1).values)
        sig = _signatures(cache, sc)
        for l in range(sig.shape[0]):
            positions = cache.layers[l].positions
            assert sig.shape[1:-1] == positions.shape
            for b in range(B):
                for g in range(G):
                    for j, p in enumerate(positions[b, g].tolist()):
                        assert torch.equal(sig[l, b, g, j], written[(b, p)])
    p0 = cache.layers[0].positions
    assert len(set(p0[0, 0].tolist()) ^ set(p0[0, 1].tolist())) > 0  # heads diverged


@dataclass
class SignatureCheckPolicy(RetentionPolicy):
    """After every forward, records each new token's signature from the cache itself (all layers and
    heads hold it then); after every compaction, checks the scorer's buffer against that record."""

    written: dict = field(default_factory=dict)
    seen: int = 0
    checked: int = 0
    diverged: bool = False

    def after_forward(self, cache, next_position, meter, prefill, tokens=None):
        new = next_position - self.seen
        vals = [ly.values[:, :, -new:] for ly in cache.layers]
        for j in range(new):
            self.written[self.seen + j] = ref_token_signature(vals, 0, j)
        self.seen = next_position
        did = super().after_forward(cache, next_position, meter, prefill, tokens)
        if did:
            sig = _signatures(cache, self.scorer)
            sig = sig if self.scorer.per_layer else sig.expand(len(cache.layers), -1, -1, -1, -1)
            for l, ly in enumerate(cache.layers):
                for g in range(ly.positions.shape[1]):
                    for j, p in enumerate(ly.positions[0, g].tolist()):
                        torch.testing.assert_close(sig[l, 0, g, j].double(), self.written[p], rtol=1e-5, atol=1e-6)
                self.diverged |= not torch.equal(ly.positions[0, 0], ly.positions[0, -1])
            self.checked += 1
        return did


@pytest.mark.parametrize("routing", ["shared", "per-layer"])
def test_signature_invariant_during_generation(tiny, tiny_stats, routing):
    sc = make_scorer("alpha", stats=str(tiny_stats), lam=1.0).structured(routing)
    pol = SignatureCheckPolicy(sc, Cadence(24, 8, "mean"))
    generate(tiny.model, list(range(3, 40)), pol, SamplingConfig(max_new_tokens=30, ignore_eos=True), set(), 1.0)
    assert pol.checked >= 3 and pol.diverged  # heads kept different tokens, so the old method would drift


def ref_greedy(scores, sig, protected, k, lam, radius):
    """Facility-location greedy for one row, plain Python, float64."""
    n = len(scores)
    sel = []
    for _ in range(k):
        best, best_j = -math.inf, None
        for j in range(n):
            if j in sel:
                continue
            if protected[j]:
                obj = math.inf
            else:
                within = [float(sig[j] @ sig[i]) for i in sel if float(sig[j] @ sig[i]) >= radius]
                obj = float(scores[j]) - lam * (max(within) if within else 0.0)
            if best_j is None or obj > best:
                best, best_j = obj, j
        sel.append(best_j)
    return sorted(sel)


@pytest.mark.parametrize("lam,radius", [(0.7, 0.0), (2.0, 0.3), (5.0, -1.0)])
def test_greedy_matches_reference(lam, radius):
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(B, G, N, generator=gen)
    sig = torch.nn.functional.normalize(torch.randn(B, G, N, D, generator=gen), dim=-1)
    sig[:, :, 4] = torch.nn.functional.normalize(sig[:, :, 2] + 0.1 * sig[:, :, 4], dim=-1)  # a near-duplicate
    protected = torch.zeros(B, G, N, dtype=torch.bool)
    protected[0, 1, 5] = protected[1, 0, 0] = True
    k = 6
    got = facility_location_keep(scores, sig, protected, k, lam, radius)
    for b in range(B):
        for g in range(G):
            want = ref_greedy(scores[b, g].double(), sig[b, g].double(), protected[b, g].tolist(), k, lam, radius)
            assert got[b, g].tolist() == want


@pytest.mark.parametrize("shape", [(B, G, N), (L, B, G, N), (1, 1, 64)])
def test_lambda_zero_is_topk_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(4)
    # Integer-valued scores: many exact ties, which both must break towards the lower index.
    scores = torch.randint(0, 4, shape, generator=gen).float()
    scores[..., 1] = float("-inf")
    protected = torch.rand(shape, generator=gen) < 0.15
    sig = torch.nn.functional.normalize(torch.randn(*shape, D, generator=gen), dim=-1)
    for k in (1, 5, shape[-1] - 1, shape[-1]):
        want = topk_keep(scores, protected & (protected.cumsum(-1) <= k), k)
        got = facility_location_keep(scores, sig, protected & (protected.cumsum(-1) <= k), k, 0.0)
        assert torch.equal(got, want)


def near_duplicate_case():
    """Scores fall with the index; values 0 and 1 are near-identical, the rest are orthogonal-ish."""
    n, d = 8, 16
    scores = torch.linspace(1.0, 0.3, n)[None, None]
    values = torch.eye(d)[:n].clone()
    values[1] = values[0] + 0.01 * torch.eye(d)[n + 1]
    return scores, torch.nn.functional.normalize(values, dim=-1)[None, None], torch.zeros(1, 1, n, dtype=torch.bool)


def test_larger_lambda_drops_the_near_duplicate():
    scores, sig, prot = near_duplicate_case()
    assert facility_location_keep(scores, sig, prot, 3, 0.0)[0, 0].tolist() == [0, 1, 2]
    assert facility_location_keep(scores, sig, prot, 3, 0.5)[0, 0].tolist() == [0, 2, 3]
    # Below the radius nothing is penalised: a radius above the duplicate's cosine restores top-k.
    assert facility_location_keep(scores, sig, prot, 3, 0.5, radius=1.01)[0, 0].tolist() == [0, 1, 2]


def test_first_pick_is_never_penalised():
    scores, sig, prot = near_duplicate_case()
    for lam in (0.0, 1.0, 1e6):
        # k = 1: the only pick is the top score whatever lambda is (the set starts empty: pen = 0).
        assert facility_location_keep(scores, sig, prot, 1, lam)[0, 0].tolist() == [0]
    # A huge lambda with every signature identical penalises every later pick equally, never the first.
    same = torch.ones_like(sig) / math.sqrt(sig.shape[-1])
    assert facility_location_keep(scores, same, prot, 3, 1e6)[0, 0].tolist() == [0, 1, 2]


def test_protected_tokens_seed_the_penalty():
    """Protected tokens enter first and their cosine rows count: the duplicate of a protected token is
    penalised, whatever its score."""
    scores, sig, _ = near_duplicate_case()
    prot = torch.zeros(1, 1, 8, dtype=torch.bool)
    prot[0, 0, 7] = True
    sig = sig.clone()
    sig[0, 0, 7] = sig[0, 0, 0]  # the protected token duplicates the top-scored one
    assert facility_location_keep(scores, sig, prot, 3, 0.0)[0, 0].tolist() == [0, 1, 7]
    assert facility_location_keep(scores, sig, prot, 3, 2.0)[0, 0].tolist() == [2, 3, 7]


def test_alpha_validates_parameters():
    from retention.errors import RetentionError

    with pytest.raises(RetentionError, match="lambda"):
        make_scorer("alpha", lam=-0.1)
    with pytest.raises(RetentionError, match="sideways"):
        make_scorer("alpha").structured("sideways")


# --------------------------------------------------------------------------------------------
# lambda = 0 vs triattention on real models: identical cache tensors and tokens
# --------------------------------------------------------------------------------------------


@dataclass
class SnapshotPolicy(RetentionPolicy):
    """Records a copy of every layer's keys, values and positions after each compaction."""

    snapshots: list = field(default_factory=list)

    def after_forward(self, cache, next_position, meter, prefill, tokens=None):
        did = super().after_forward(cache, next_position, meter, prefill, tokens)
        if did:
            self.snapshots.append([(ly.keys.clone(), ly.values.clone(), ly.positions.clone()) for ly in cache.layers])
        return did


def run_pair(model, prompt, stats_path, budget, interval, n_new, routing="shared"):
    out = {}
    for name, extra in (("triattention", {}), ("alpha", {"lam": 0.0})):
        sc = make_scorer(name, stats=str(stats_path), **extra).structured(routing)
        pol = SnapshotPolicy(sc, Cadence(budget, interval, "mean"))
        g = generate(model, prompt, pol, SamplingConfig(max_new_tokens=n_new, ignore_eos=True), set(), 1.0,
                     keep_logits=True)
        out[name] = (g, pol.snapshots)
    return out


def assert_identical(out):
    (g_t, snap_t), (g_a, snap_a) = out["triattention"], out["alpha"]
    assert g_t.meter.compactions >= 3 and len(snap_t) == len(snap_a) == g_t.meter.compactions
    for st, sa in zip(snap_t, snap_a):
        for (kt, vt, pt), (ka, va, pa) in zip(st, sa):
            assert torch.equal(kt, ka) and torch.equal(vt, va) and torch.equal(pt, pa)
    assert g_t.token_ids == g_a.token_ids
    assert all(torch.equal(a, b) for a, b in zip(g_t.step_logits, g_a.step_logits))


@pytest.fixture(scope="module")
def tiny_stats(tiny, tmp_path_factory):
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    return calibrate(tiny.model, ids).save(tmp_path_factory.mktemp("stats") / "tiny.safetensors")


@pytest.mark.parametrize("routing", ["shared", "per-layer"])
def test_alpha_lambda_zero_equals_triattention_tiny(tiny, tiny_stats, routing):
    prompt = list(range(3, 60))
    assert_identical(run_pair(tiny.model, prompt, tiny_stats, 32, 8, 40, routing))


@pytest.mark.smollm
def test_alpha_lambda_zero_equals_triattention_smollm(smollm, tmp_path):
    text = "Let x be a real number such that x^2 - 5x + 6 = 0. Find all possible values of x. " * 6
    ids = smollm.tokenizer(text)["input_ids"]
    stats = calibrate(smollm.model, ids).save(tmp_path / "smollm.safetensors")
    prompt = smollm.tokenizer("Compute the sum of the first twenty positive odd integers. Let's think.")["input_ids"]
    assert_identical(run_pair(smollm.model, prompt, stats, 16, 4, 16))
