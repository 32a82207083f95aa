"""Reference attention modules (retention.models.arch): exactness, transformers' DeepSeek-V2, parameter
counts, and retention on latent and shared-storage caches."""

from __future__ import annotations

import pytest
import torch

from retention.models.arch.configs import (
    DOCUMENTED_CONFIGS,
    DOCUMENTED_PARAMETERS,
    TINY,
    ArchConfig,
)
from retention.models.arch.model import ArchLM, build_arch, count_parameters
from retention.errors import RetentionError
from retention.runs.teacher_forced import decode
from retention.models.layouts import tokens_for_bytes
from retention.policy.registry import make_scorer

SCORERS = ("full", "random", "streaming", "h2o", "snapkv")  # what a layout model provides for

TOKENS = [int(t) for t in torch.randint(0, 259, (28,), generator=torch.Generator().manual_seed(1))]
PROMPT = 8


def _full_logits(model: ArchLM, ids: list[int]) -> torch.Tensor:
    """[n, V] logits of one forward over the whole sequence (a fresh cache, no decode steps)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], model.new_cache()).logits[0]


@pytest.mark.parametrize("name", list(TINY))
def test_incremental_decode_equals_one_forward(name):
    model = build_arch(name, dtype=torch.float64)
    run = decode(model, TOKENS, PROMPT, "full")
    full = _full_logits(model, TOKENS)
    got = torch.stack(run.logits)
    assert torch.allclose(got, full[PROMPT - 1:], atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-qk-norm-mla"])
def test_absorbed_equals_materialised_float64(name):
    model = build_arch(name, dtype=torch.float64)
    model.set_absorb(True)
    absorbed = torch.stack(decode(model, TOKENS, PROMPT, "full").logits)
    model.set_absorb(False)
    naive = torch.stack(decode(model, TOKENS, PROMPT, "full").logits)
    assert (absorbed - naive).abs().max() < 1e-9
    assert absorbed.std() > 0.1  # far from a constant output: the comparison means something


@pytest.mark.parametrize(("version", "q_lora_rank"), [("v2", None), ("v3", 16), ("v3", None)])
def test_mla_equals_transformers_deepseek(version, q_lora_rank):
    """Full-cache logits of the reference MLA against transformers' DeepseekV2/V3 (dense layers,
    weights shared); V3 with and without its compressed queries."""
    import transformers

    prefix = "DeepseekV2" if version == "v2" else "DeepseekV3"
    extra = {} if version == "v2" else {"rope_interleave": True}
    hf_config = getattr(transformers, f"{prefix}Config")(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, first_k_dense_replace=3, rms_norm_eps=1e-6, tie_word_embeddings=False,
        # 0.1: logits of a few units, where float32 rounding (of either implementation) stays below 1e-5.
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, initializer_range=0.1,
        attn_implementation="eager", **extra,
    )
    torch.manual_seed(0)
    hf = getattr(transformers, f"{prefix}ForCausalLM")(hf_config).eval()
    ours = ArchLM(ArchConfig("mla", layers=3, hidden=64, q_heads=4, vocab=259, ffn=128, latent_dim=24, rope_dim=8,
                             nope_dim=16, v_dim=16, q_lora_rank=q_lora_rank or 0)).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms away from 1 so that their weights are checked too
            p.add_(torch.randn_like(p) * 0.05)
    ours.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        want = hf(ids).logits[0]
    got = _full_logits(ours, TOKENS)
    assert (got - want).abs().max() < 1e-5
    assert want.std() > 0.1


@pytest.mark.parametrize("name", list(DOCUMENTED_CONFIGS))
def test_documented_parameter_counts(name):
    assert count_parameters(DOCUMENTED_CONFIGS[name]) == DOCUMENTED_PARAMETERS[name]


def test_path_mla_width_is_the_one_integer_that_matches_mla():
    """Path-on-MLA's SwiGLU width is derived (PARAMETER_NOTES): the width at which its total equals
    MLA's, an integer only with the V delta normalised."""
    from dataclasses import replace

    cfg = DOCUMENTED_CONFIGS["path-mla"]
    per_unit = 3 * cfg.hidden * cfg.layers  # parameters per unit of SwiGLU width
    without_ffn = count_parameters(replace(cfg, ffn=1)) - per_unit
    width, rest = divmod(DOCUMENTED_PARAMETERS["mla"] - without_ffn, per_unit)
    assert (width, rest) == (cfg.ffn, 0) == (1792, 0)
    v_delta_norms = cfg.layers * cfg.layer_dim
    assert (DOCUMENTED_PARAMETERS["mla"] - (without_ffn - v_delta_norms)) % per_unit != 0


@pytest.mark.parametrize("name", list(DOCUMENTED_CONFIGS))
def test_documented_configs_store_the_documented_layout(name):
    from retention.models.layouts import DOCUMENTED

    assert DOCUMENTED_CONFIGS[name].cache_layout().elements_per_token == DOCUMENTED[name].elements_per_token


@pytest.mark.parametrize("name", list(TINY))
def test_stored_bytes_equal_the_layout(name):
    model = build_arch(name)
    run = decode(model, TOKENS, PROMPT, "h2o", budget=16, interval=4, sink=2)
    layout = model.cache_layout()
    assert run.compactions > 0
    assert run.stored_bytes == [n * layout.bytes_per_token for n in run.stored]


def _grid(scorers, fast):
    """Every (layout, scorer); the pairs outside `fast` are marked slow (the grid takes minutes)."""
    return [pytest.param(n, s, marks=() if s == fast else pytest.mark.slow) for n in TINY for s in scorers]


@pytest.mark.parametrize(("name", "scorer"), _grid([s for s in SCORERS if s != "full"], "h2o"))  # full: above
def test_every_scorer_is_exact_at_an_unlimited_budget(name, scorer):
    model = build_arch(name, dtype=torch.float64)
    run = decode(model, TOKENS, PROMPT, scorer, budget=len(TOKENS) + 10, interval=1, sink=1)
    full = _full_logits(model, TOKENS)
    assert torch.allclose(torch.stack(run.logits), full[PROMPT - 1:], atol=1e-9, rtol=0)


@pytest.mark.parametrize(("name", "scorer"), _grid(["random", "streaming", "h2o", "snapkv"], "snapkv"))
def test_eviction_is_shared_per_group_and_changes_the_output(name, scorer):
    model = build_arch(name, dtype=torch.float64)
    layout = model.cache_layout()

    def check(cache):
        n = cache.lengths[0]
        for g, members in enumerate(cache.groups):
            group = cache.layers[g]
            # every store the group's layers read is gathered with the group's one kept set
            reads = {s.name for s in layout.stores if set(s.readers) & set(members)}
            assert set(group.stores) == reads
            assert group.positions.shape[-1] == n and all(b.shape[2] == group.pbuf.shape[2]
                                                          for b in group.stores.values())

    run = decode(model, TOKENS, PROMPT, scorer, budget=16, interval=4, sink=2, on_compaction=check)
    assert run.compactions > 0 and max(run.stored) <= 16 + 4
    full = _full_logits(model, TOKENS)
    assert not torch.allclose(torch.stack(run.logits), full[PROMPT - 1:], atol=1e-6)


def test_compacting_to_everything_is_bit_identical():
    model = build_arch("tiny-path-residual", dtype=torch.float64)
    cache = model.new_cache()
    ids = torch.tensor([TOKENS[:10]])
    with torch.no_grad():
        model(ids, torch.arange(10)[None], cache)
        cache.compact(torch.arange(10).expand(len(cache.groups), 1, cache.layout.kv_heads, -1))
        a = model(torch.tensor([[TOKENS[10]]]), torch.tensor([[10]]), cache).logits
        b = _full_logits(model, TOKENS[:11])[-1]
    assert torch.allclose(a[0, -1], b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["triattention", "alpha"])
def test_position_statistic_scorers_are_refused(name):
    from retention.runs.arms import validate_arm

    with pytest.raises(RetentionError, match=r"tiny-cla cache: it reads .*latent.* provides attention, positions \(calibration, .*missing\)"):
        validate_arm({"model": "tiny-cla", "scorer": name, "budget": 16})  # tiny-mla: tests/retention/policy/scoring/test_latent_run.py


def test_budget_bytes_matches_memory_across_layouts():
    kv_layout = build_arch("tiny-kv").new_cache().layout
    mla_layout = build_arch("tiny-mla").new_cache().layout
    assert tokens_for_bytes(kv_layout, 8192) == 8192 // kv_layout.bytes_per_token
    assert tokens_for_bytes(mla_layout, 8192) > tokens_for_bytes(kv_layout, 8192)
    with pytest.raises(RetentionError, match="holds no token"):
        tokens_for_bytes(kv_layout, 10)
    run = decode(build_arch("tiny-mla"), TOKENS, PROMPT, "streaming", budget_bytes=12 * mla_layout.bytes_per_token,
                 interval=4, sink=2)
    assert max(run.stored_bytes) <= (12 + 4) * mla_layout.bytes_per_token


@pytest.mark.parametrize("name", list(TINY))
def test_h2o_mass_is_every_query_head_of_every_layer_in_the_group(name):
    """Each query head's probabilities sum to 1 over the stored tokens, so before any eviction a
    group's accumulated mass is (its layers) x (query heads) x (queries seen)."""
    model = build_arch(name, dtype=torch.float64)
    cache = model.new_cache()
    cache.collect_attention = True
    scorer = make_scorer("h2o")
    with torch.no_grad():
        model(torch.tensor([TOKENS[:10]]), torch.arange(10)[None], cache)
        scorer.observe(cache, [10])
        model(torch.tensor([[TOKENS[10]]]), torch.tensor([[10]]), cache)
        scorer.observe(cache, [11])
    for g, members in enumerate(cache.groups):
        mass = cache.layers[g].extra[scorer.EXTRA][:, :, :11]
        assert mass.shape == (1, cache.layout.kv_heads, 11)
        assert abs(float(mass.sum()) - len(members) * model.config.q_heads * 11) < 1e-9


def test_tied_embeddings_share_one_matrix():
    tied = ArchConfig("kv", tie_embeddings=True)
    model = build_arch(tied)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert count_parameters(tied) == count_parameters(ArchConfig("kv")) - tied.vocab * tied.hidden
