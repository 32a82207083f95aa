"""Nucleus (top-p) sampling: the prefix rule of the descending order, with equal probabilities at
the boundary kept together (no dependence on how a sort orders ties), row by row as alone."""

import pytest
import torch

from retention.runtime import sampling
from retention.runtime.sampling import SamplingConfig, inverse_cdf, nucleus, sample_tokens


def by_sort(probs, top_p):
    """The textbook rule: sort, keep the smallest prefix whose mass reaches top_p."""
    sorted_p, order = torch.sort(probs, descending=True)
    drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))


def test_without_ties_the_nucleus_is_the_sorted_prefix():
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 3.0, 10.0):
        probs = torch.softmax(torch.randn(8, 5000, generator=g, dtype=torch.float64) * scale, -1)
        for top_p in (0.01, 0.5, 0.95, 0.999):
            assert torch.equal(nucleus(probs, top_p), by_sort(probs, top_p))


def test_ties_at_the_boundary_are_kept_together_in_any_order():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]], dtype=torch.float64)
    got = nucleus(probs, 0.5)  # the prefix rule stops inside the tie of 0.2s: both stay
    assert torch.equal(got, torch.tensor([[0.4, 0.2, 0.2, 0.0, 0.0]], dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 3000, generator=g) * 4).to(torch.bfloat16).float()  # many equal values
    probs = torch.softmax(logits, -1)
    perm = torch.randperm(3000, generator=g)
    for top_p in (0.5, 0.9, 0.95):
        assert torch.equal(nucleus(probs[:, perm], top_p), nucleus(probs, top_p)[:, perm])


def test_cpu_candidates_give_what_the_whole_sort_gives(monkeypatch):
    g = torch.Generator().manual_seed(2)
    probs = torch.softmax((torch.randn(16, 20000, generator=g) * torch.linspace(0.2, 8, 16)[:, None]), -1)
    want = {p: nucleus(probs, p) for p in (0.5, 0.95)}
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 64)  # most rows' nuclei reach past 64 tokens
    for top_p, w in want.items():
        assert torch.equal(nucleus(probs, top_p), w)


def test_a_row_samples_what_it_samples_alone():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 4000, generator=g) * 3).to(torch.bfloat16)
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    gens = lambda: [torch.Generator().manual_seed(10 + r) for r in range(6)]  # noqa: E731
    together = sample_tokens(logits, cfg, gens())
    alone = torch.cat([sample_tokens(logits[r:r + 1], cfg, [gens()[r]]) for r in range(6)])
    assert torch.equal(together, alone)


def textbook_draw(probs, top_p, u):
    """The inverse-CDF draw written out row by row: the nucleus (`by_sort`'s prefix, widened to every
    token as probable as its last one), its tokens in id order, the first whose running float64 sum
    exceeds u times the total."""
    out = []
    for p, w in zip(probs.double().tolist(), u.tolist()):
        order = sorted(range(len(p)), key=lambda i: -p[i])
        mass, last = 0.0, None
        for i in order:  # the prefix of the descending order whose mass reaches top_p
            if mass >= top_p:
                break
            mass, last = mass + p[i], p[i]
        kept = [i for i in range(len(p)) if (p[i] >= last if top_p < 1 else p[i] > 0)]
        total = 0.0
        for i in kept:
            total += p[i]
        target, run, pick = w * total, 0.0, kept[-1]
        for i in kept:
            run += p[i]
            if run > target:
                pick = i
                break
        out.append(pick)
    return out


@pytest.mark.parametrize("candidates", [(256, 4096), (3, 40), (1, 2)])
def test_inverse_cdf_is_the_textbook_draw_whatever_the_candidates(candidates, monkeypatch):
    """The tiered CPU draw (first candidates, wider ones, the whole row) picks the token the
    written-out rule picks, with bfloat16 ties at every boundary."""
    monkeypatch.setattr(sampling, "DRAW_CANDIDATES", candidates[0])
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates[1])
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(24, 600, generator=g) * torch.linspace(0.3, 12, 24)[:, None]).to(torch.bfloat16).float()
    probs = torch.softmax(logits, -1)
    u = torch.rand(24, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2 ** -53  # the ends of [0, 1)
    for top_p in (0.2, 0.9, 0.95, 1.0):
        tok, reads = inverse_cdf(probs, top_p, u)
        float_probs = probs.float()  # the draw sums float32 probabilities in float64, as the reference does
        assert tok.tolist() == textbook_draw(float_probs, top_p, u), top_p
        assert reads <= 2


def test_inverse_cdf_gives_the_nucleus_distribution():
    """Uniforms on a fine grid land on each nucleus token in proportion to its probability."""
    probs = torch.tensor([[0.05, 0.3, 0.0, 0.15, 0.2, 0.3]], dtype=torch.float32)
    N = 20000
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    tok, _ = inverse_cdf(probs.expand(N, -1).contiguous(), 0.9, u)
    counts = torch.bincount(tok, minlength=6).tolist()
    kept = {1: 0.3, 3: 0.15, 4: 0.2, 5: 0.3}  # 0.3 + 0.3 + 0.2 reaches 0.8 < 0.9, then 0.15: 0.95
    total = sum(kept.values())
    assert counts[0] == counts[2] == 0
    for i, p in kept.items():
        assert abs(counts[i] - N * p / total) <= 1


@pytest.mark.parametrize("sampler", ["inverse-cdf", "multinomial"])
def test_each_sampler_draws_a_row_as_alone(sampler):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 4000, generator=g) * 6).to(torch.bfloat16)
    cfg = SamplingConfig(temperature=0.7, top_p=0.9, sampler=sampler)
    gens = lambda: [torch.Generator().manual_seed(20 + r) for r in range(6)]  # noqa: E731
    together = sample_tokens(logits, cfg, gens())
    alone = torch.cat([sample_tokens(logits[r:r + 1], cfg, [gens()[r]]) for r in range(6)])
    assert torch.equal(together, alone)


def test_the_samplers_draw_differently_from_one_distribution():
    """Same seeds, same nucleus: other tokens (the draw differs), the same frequencies."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]])
    counts = {}
    for sampler in ("inverse-cdf", "multinomial"):
        cfg = SamplingConfig(temperature=1.0, top_p=0.95, sampler=sampler)
        toks = [int(sample_tokens(logits, cfg, [torch.Generator().manual_seed(s)])[0]) for s in range(3000)]
        counts[sampler] = toks
    assert counts["inverse-cdf"] != counts["multinomial"]
    want = nucleus(torch.softmax(logits, -1), 0.95)[0]
    want = want / want.sum()
    for toks in counts.values():
        freq = torch.bincount(torch.tensor(toks), minlength=6).double() / len(toks)
        assert torch.allclose(freq, want.double(), atol=0.03)


def test_an_unknown_sampler_is_refused():
    with pytest.raises(ValueError, match="sampler must be one of inverse-cdf, multinomial"):
        SamplingConfig(sampler="gumbel")


@pytest.mark.parametrize("candidates", [(2, 3), (3, 4), (256, 4096)])
def test_inverse_cdf_at_exact_boundaries(candidates, monkeypatch):
    """A tie that runs past the candidates stays whole in the nucleus, and a uniform that lands
    exactly on a partial sum takes the next token (the first sum that exceeds it)."""
    monkeypatch.setattr(sampling, "DRAW_CANDIDATES", candidates[0])
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates[1])
    tie = torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])  # the prefix stops inside the 0.1s: all stay
    u = (torch.arange(10, dtype=torch.float64) + 0.5) / 10
    tok, _ = inverse_cdf(tie.expand(10, -1).contiguous(), 0.55, u)
    assert sorted(set(tok.tolist())) == [0, 1, 2, 3, 4, 5]
    assert tok.tolist() == textbook_draw(tie.expand(10, -1), 0.55, u)
    exact = torch.tensor([[0.25, 0.25, 0.5]])  # partial sums 0.25, 0.5, 1.0 exactly
    tok, _ = inverse_cdf(exact.expand(3, -1).contiguous(), 1.0, torch.tensor([0.0, 0.25, 0.5], dtype=torch.float64))
    assert tok.tolist() == [0, 1, 2]
    tok, _ = inverse_cdf(exact.expand(3, -1).contiguous(), 0.99, torch.tensor([0.0, 0.25, 0.5], dtype=torch.float64))
    assert tok.tolist() == [0, 1, 2]
    two = torch.tensor([[0.25, 0.25, 0.125, 0.125, 0.125, 0.125]])  # nucleus {0, 1} at 0.3, total 0.5
    tok, _ = inverse_cdf(two.expand(3, -1).contiguous(), 0.3, torch.tensor([0.0, 0.5, 0.75], dtype=torch.float64))
    assert tok.tolist() == [0, 1, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_greedy_is_argmax_with_ties_nan_and_inf(dtype):
    """`greedy` picks what `argmax` picks: the first maximum, NaN counting as the largest."""
    g = torch.Generator().manual_seed(3)
    for trial in range(120):
        rows, vocab = int(torch.randint(1, 70, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
        x = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)  # many ties
        if trial % 3 == 0:
            x[torch.rand(rows, vocab, generator=g) < 0.01] = float("nan")
        if trial % 5 == 0:
            x[0] = float("-inf")
        if trial % 7 == 0:
            x[:, : vocab // 2] = float("inf")
        assert torch.equal(sampling.greedy(x), x.argmax(-1)), trial
    x = torch.randn(64, 151936, generator=g).to(dtype)
    assert torch.equal(sampling.greedy(x), x.argmax(-1))
