"""Nucleus (top-p) sampling: the prefix rule of the descending order, with equal probabilities at
the boundary kept together (no dependence on how a sort orders ties), row by row as alone."""

import torch

from retention.runtime import sampling
from retention.runtime.sampling import SamplingConfig, nucleus, sample_tokens


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
