"""The query-capture mechanism: bit-identical outputs, restored implementation, the right queries."""

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from retention.runtime.cache import RetentionCache
from retention.runtime.capture import CAPTURE_NAME, capture_queries
from retention.errors import RetentionError
from retention.runtime.generate import _cache_kwarg

IDS = torch.tensor([[5, 17, 3, 99, 42, 8, 8, 61, 23, 70, 2]])


def model_with(impl):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, initializer_range=0.2,
                      attn_implementation=impl)
    return Qwen2ForCausalLM(cfg).eval()


def prefill_and_decode(model, cache):
    """Prefill IDS then decode two tokens; returns the logits of every forward."""
    kw = _cache_kwarg(model)
    out = []
    n = IDS.shape[1]
    with torch.inference_mode():
        for ids, pos in ((IDS, torch.arange(n)[None]), (IDS[:, :1], torch.tensor([[n]])),
                         (IDS[:, 1:2], torch.tensor([[n + 1]]))):
            if isinstance(cache, RetentionCache):
                cache.set_step_positions(pos)
            out.append(model(input_ids=ids, position_ids=pos, use_cache=True, **{kw: cache}).logits)
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_outputs_bit_identical_and_implementation_restored(impl):
    model = model_with(impl)
    plain = prefill_and_decode(model, DynamicCache(config=model.config))
    with capture_queries(model):
        assert model.config._attn_implementation.startswith(CAPTURE_NAME)
        # Without a registered mask function transformers would build no causal mask: eager prefill
        # would then attend to the future and these logits would differ.
        assert ALL_MASK_ATTENTION_FUNCTIONS[model.config._attn_implementation] is ALL_MASK_ATTENTION_FUNCTIONS[impl]
        captured = prefill_and_decode(model, RetentionCache(2))
    assert model.config._attn_implementation == impl
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))


def test_restored_on_exception_and_no_nesting():
    model = model_with("sdpa")
    with pytest.raises(ValueError):
        with capture_queries(model):
            raise ValueError("boom")
    assert model.config._attn_implementation == "sdpa"
    with capture_queries(model):
        with pytest.raises(RetentionError, match="already"):
            with capture_queries(model):
                pass
    assert model.config._attn_implementation == "sdpa"
    with torch.inference_mode():  # and recording really stopped
        model(input_ids=IDS)


def test_recorded_queries_are_the_post_rope_queries():
    model = model_with("sdpa")
    cache = RetentionCache(2)
    pos = torch.arange(IDS.shape[1])[None] + 100  # positions need not start at 0
    with torch.inference_mode(), capture_queries(model) as rec:
        cache.set_step_positions(pos)
        hs = model(input_ids=IDS, position_ids=pos, use_cache=True, **{_cache_kwarg(model): cache},
                   output_hidden_states=True).hidden_states
        calls = rec.take(cache)
        attn = model.model.layers[1].self_attn
        x = model.model.layers[1].input_layernorm(hs[1])
        q = attn.q_proj(x).view(1, IDS.shape[1], 6, 8).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, pos)
        q_rot, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert len(calls) == 2 and calls[1].scaling == 8 ** -0.5
    torch.testing.assert_close(calls[1].query, q_rot)


def test_take_picks_the_retention_cache_among_several_forwards():
    """As with generate(fidelity=True): the same step also runs through a reference DynamicCache whose
    stored keys differ; take(cache) must return the calls made against `cache`."""
    model = model_with("sdpa")
    ret, ref = RetentionCache(2), DynamicCache(config=model.config)
    kw = _cache_kwarg(model)
    n = IDS.shape[1]
    with torch.inference_mode(), capture_queries(model) as rec:
        pos = torch.arange(n)[None]
        ret.set_step_positions(pos)
        model(input_ids=IDS, position_ids=pos, use_cache=True, **{kw: ret})
        rec.take(ret)
        ret.compact(torch.tensor([[[0, 3, 5, 9, 10]] * 2]))  # the retained cache now differs
        pos = torch.tensor([[n]])
        ret.set_step_positions(pos)
        model(input_ids=IDS[:, :1], position_ids=pos, use_cache=True, **{kw: ret})
        model(input_ids=IDS, position_ids=torch.arange(n)[None], use_cache=True, **{kw: ref})
        model(input_ids=IDS[:, :1], position_ids=pos, use_cache=True, **{kw: ref})
        calls = rec.take(ret)
        assert [c.key.shape[2] for c in calls] == [6, 6]
        assert all(c.key is layer.keys for c, layer in zip(calls, ret.layers))
        with pytest.raises(RuntimeError, match="matches"):
            rec.take(ret)  # nothing recorded since
