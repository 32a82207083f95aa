"""The plugin's own test: scores on a hand-made view, and the contract kit's verdict."""

import torch

from keynorm_scorer import KeyNorm
from retention.runtime.cache import CacheView


def test_larger_keys_score_higher_and_padding_is_minus_inf():
    keys = [torch.tensor([[[[1.0, 0.0], [3.0, 4.0], [0.0, 2.0]]]])] * 2  # L=2 layers of [B=1, G=1, n=3, d=2]
    valid = [torch.tensor([[[True, True, False]]])] * 2
    pos = [torch.tensor([[[0, 1, -1]]])] * 2
    view = CacheView(keys, keys, pos, [torch.zeros(1, 1, 3, dtype=torch.bool)] * 2, 2, valid)
    s = KeyNorm().score(view)
    assert s.shape == (1, 1, 3)
    assert s[0, 0, 1] > s[0, 0, 0] and s[0, 0, 2] == float("-inf")


def test_contract_kit_passes():
    from retention.contract import run_checks

    results = run_checks("keynorm_scorer:KeyNorm", {}, share=False)
    assert all(r.ok for r in results), [r.line() for r in results if not r.ok]
