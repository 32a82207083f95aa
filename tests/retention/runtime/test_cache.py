"""The retention cache: compaction is exact at the attention level and really frees memory."""

import pytest
import torch
import torch.nn.functional as F

from retention.runtime.cache import RetentionCache


def _filled_cache(L, B, G, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = RetentionCache(L)
    keys = [torch.randn(B, G, n, d, generator=g) for _ in range(L)]
    values = [torch.randn(B, G, n, d, generator=g) for _ in range(L)]
    cache.set_step_positions(torch.arange(n).expand(B, n))
    for i in range(L):
        cache.update(keys[i], values[i], i)
    return cache, keys, values


@pytest.mark.parametrize("B,G,r,n,d,k", [(1, 2, 3, 37, 16, 11), (2, 3, 2, 50, 8, 20), (1, 1, 4, 9, 4, 1)])
def test_compacted_attention_equals_masked_full_attention(B, G, r, n, d, k):
    """Attention over the compacted cache == attention over the full cache with evicted tokens masked."""
    L = 2
    cache, keys, values = _filled_cache(L, B, G, n, d)
    g = torch.Generator().manual_seed(1)
    # Per-head different kept sets (sorted), as a scorer would produce.
    keep = torch.stack([torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(G)])
                        for _ in range(B)])
    cache.compact(keep)
    q = torch.randn(B, G * r, 1, d, generator=g)
    for layer in range(L):
        kc, vc = cache.layers[layer].keys, cache.layers[layer].values
        got = F.scaled_dot_product_attention(q, kc.repeat_interleave(r, 1), vc.repeat_interleave(r, 1))
        mask = torch.zeros(B, G, n, dtype=torch.bool)
        mask.scatter_(2, keep, True)
        full_mask = mask.repeat_interleave(r, 1)[:, :, None, :]
        want = F.scaled_dot_product_attention(q, keys[layer].repeat_interleave(r, 1),
                                              values[layer].repeat_interleave(r, 1), attn_mask=full_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # positions follow their tokens
        assert torch.equal(cache.layers[layer].positions, keep)


def test_compaction_frees_memory_and_keeps_order():
    cache, keys, _ = _filled_cache(3, 1, 2, 40, 8)
    keep = torch.tensor([[[0, 5, 7, 39], [1, 2, 3, 4]]])
    cache.compact(keep)
    for i, layer in enumerate(cache.layers):
        assert layer.keys.shape == (1, 2, 4, 8)
        assert layer.keys.numel() == 1 * 2 * 4 * 8 and layer.values.numel() == 1 * 2 * 4 * 8
        assert torch.equal(layer.keys[0, 0], keys[i][0, 0, [0, 5, 7, 39]])
        assert torch.equal(layer.keys[0, 1], keys[i][0, 1, [1, 2, 3, 4]])
    assert cache.stored_lengths() == [4, 4, 4]
    # new tokens append after the compacted ones with their true absolute position
    cache.set_step_positions(torch.tensor([[40]]))
    for i in range(3):
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), i)
    assert cache.layers[0].positions[0, 0].tolist() == [0, 5, 7, 39, 40]


def test_per_layer_compaction():
    cache, keys, _ = _filled_cache(2, 1, 1, 10, 4)
    keep = torch.tensor([[[[1, 2]]], [[[3, 9]]]])  # [L, B, G, k]
    cache.compact(keep)
    assert cache.layers[0].positions.tolist() == [[[1, 2]]]
    assert cache.layers[1].positions.tolist() == [[[3, 9]]]


def test_view_protects_sinks_and_recent():
    cache, _, _ = _filled_cache(1, 1, 1, 20, 4)
    view = cache.view(next_position=20, sink=2, recent=3)
    assert view.protected[0][0, 0].nonzero().flatten().tolist() == [0, 1, 17, 18, 19]


def test_update_without_positions_is_refused():
    cache = RetentionCache(1)
    with pytest.raises(RuntimeError):
        cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 0)



def test_a_scorer_writing_into_its_view_does_not_change_the_cache(tiny):
    """A view of every row is a copy, not a slice of the live buffers: zeroing what a scorer was shown
    decodes the same tokens as only reading it."""
    from tests.retention.contract.test_checks import WritesIntoView

    from retention.policy.cadence.base import Cadence
    from retention.runtime.engine import Request, SamplingConfig, run_engine
    from retention.policy.composite import RetentionPolicy

    class ReadsOnly(WritesIntoView):
        def score(self, view):
            return view.positions[0].float().masked_fill(~view.valid[0], float("-inf"))

    def decode(scorer):
        got = {}
        policy = RetentionPolicy(scorer, Cadence(budget=20, interval=4, accounting="prefill", sink=4, recent=0))
        run_engine(tiny.model, [Request(0, list(range(3, 40)), 0)], policy, SamplingConfig(max_new_tokens=24),
                   set(), tiny.geometry.kib_per_token, on_finish=lambda req, g: got.update({req.key: g.token_ids}))
        return got[0]

    assert decode(WritesIntoView()) == decode(ReadsOnly())
