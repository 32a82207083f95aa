"""DeepSeek-V2/V3 checkpoints on the reference MLA (`retention.models.arch.deepseek`, how `retention run`
always decodes them, through the one engine): transformers' logits with MoE layers and YaRN, shared
weights, exactness at an unlimited budget, and the CLI with its refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from click.testing import CliRunner

from retention.models.arch.deepseek import DeepseekReference
from retention.policy.cadence.base import Cadence
from retention.cli import main
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.composite import RetentionPolicy
from retention.policy.registry import make_scorer
from retention.models import build_tiny_tokenizer

TOKENS = [int(t) for t in torch.randint(0, 259, (28,), generator=torch.Generator().manual_seed(1))]
YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}


def _deepseek(version: str = "v2", q_lora_rank=None, rope=DEFAULT_ROPE, interleave: bool = True, init=0.1):
    """A seeded random DeepSeek causal LM: 3 layers (1 dense, 2 MoE of 4 routed + 1 shared expert)."""
    prefix = "DeepseekV2" if version == "v2" else "DeepseekV3"
    extra = {} if version == "v2" else {"n_group": 1, "topk_group": 1, "rope_interleave": interleave}
    tok = build_tiny_tokenizer()
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters=rope, initializer_range=init, attn_implementation="eager",
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
        with torch.no_grad():
            for p in model.parameters():  # norms away from 1, so that their weights are checked too
                p.add_(torch.randn_like(p) * 0.05)
    return model, tok


@pytest.mark.parametrize(("version", "q_lora_rank", "rope", "interleave"), [
    ("v2", None, DEFAULT_ROPE, True), ("v2", None, YARN, True), ("v3", 16, YARN, True), ("v3", None, DEFAULT_ROPE, False),
])
def test_logits_equal_transformers_with_moe_and_yarn(version, q_lora_rank, rope, interleave):
    hf, _ = _deepseek(version, q_lora_rank, rope, interleave)
    ref = DeepseekReference(hf).eval()
    with torch.no_grad():
        want = hf(torch.tensor([TOKENS])).logits[0]
        cache = ref.new_cache()
        got = [ref(torch.tensor([TOKENS[:10]]), torch.arange(10)[None], cache).logits[0, -1]]
        for i in range(10, len(TOKENS)):  # absorbed decode, one token per step on the latent cache
            got.append(ref(torch.tensor([[TOKENS[i]]]), torch.tensor([[i]]), cache).logits[0, -1])
    assert (torch.stack(got) - want[9:]).abs().max() < 1e-5 and want.std() > 0.1
    assert cache.nbytes() == len(TOKENS) * ref.new_cache().layout.bytes_per_token
    from retention.models.layouts import layout_from_config  # what the meter of a run of this checkpoint uses

    assert layout_from_config(hf.config, torch.float32).bytes_per_token == ref.new_cache().layout.bytes_per_token


def test_every_weight_is_the_checkpoints():
    hf, _ = _deepseek("v3", 16)
    ref = DeepseekReference(hf)
    assert {id(p) for p in ref.parameters()} == {id(p) for p in hf.parameters()}


def _engine(model, requests, scorer, cadence, sampling, batch_size=1, fidelity=False):
    done = {}
    run_engine(model, requests, RetentionPolicy(make_scorer(scorer), cadence), sampling, set(),
               model.cache_layout().kib_per_token, batch_size=batch_size, fidelity=fidelity,
               on_finish=lambda r, g: done.setdefault(r.key, g))
    return done


def test_unlimited_budget_equals_the_full_cache():
    hf, _ = _deepseek()
    ref = DeepseekReference(hf).eval()
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    runs = {s: _engine(ref, [Request("p", TOKENS[:16], 0)], s, Cadence(None if s == "full" else 100, 1, sink=1),
                       sampling, fidelity=True)["p"] for s in ("full", "h2o", "snapkv")}
    assert runs["h2o"].token_ids == runs["snapkv"].token_ids == runs["full"].token_ids
    assert all(max(g.fidelity.kl) == 0.0 for g in runs.values())


def _run(*args):
    return CliRunner().invoke(main, ["run", "--quiet", "--limit", "1", "--max-new-tokens", "10", "--ignore-eos",
                                     "--temperature", "0", *args])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek") / "m"
    model, tok = _deepseek(init=0.2)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_run_decodes_a_checkpoint_on_the_reference_mla(checkpoint, tmp_path, monkeypatch):
    import retention.runtime.engine as engine

    models = []
    real = engine.ModelAdapter.__init__

    def spy(self, model):
        models.append(type(model).__name__)
        real(self, model)

    monkeypatch.setattr(engine.ModelAdapter, "__init__", spy)
    res = _run("--model", str(checkpoint), "--scorer", "h2o,snapkv", "--budget", "24", "--interval", "8",
               "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert set(models) == {"DeepseekReference"}
    for d in tmp_path.iterdir():
        config = json.loads((d / "config.json").read_text())["config"]
        (record,) = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
        assert "engine" not in config and record["compactions"] > 0
        assert record["cache_mean_tokens"] <= 24 and record["output_tokens"] == 10


@pytest.mark.parametrize(("model", "args", "message"), [
    ("CHECKPOINT", ["--scorer", "alpha"], "no calibration statistics at"),  # it runs with them (test_latent_run.py)
    ("CHECKPOINT", ["--scorer", "rkv"], "rkv cannot score"),
    ("tiny-mla", ["--engine", "reference", "--scorer", "h2o"], "'reference' is not one of 'hf', 'vllm'"),
])
def test_refusals(checkpoint, tmp_path, model, args, message):
    model = str(checkpoint) if model == "CHECKPOINT" else model
    res = _run("--model", model, "--budget", "24", *args, "--out", str(tmp_path / "o"))
    assert res.exit_code == 1 and message in res.output and res.output.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_batched_decode_is_batch_invariant():
    hf, _ = _deepseek("v3", 16, YARN)
    ref = DeepseekReference(hf).eval()  # float32: the MoE grouped matmul has no float64 kernel
    g = torch.Generator().manual_seed(2)
    requests = [Request(f"p{i}", [int(t) for t in torch.randint(0, 256, (8 + 3 * i,), generator=g)], i) for i in range(4)]
    sampling = SamplingConfig(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    runs = [_engine(ref, requests, "snapkv", Cadence(16, 4, sink=1, recent=8), sampling, batch_size=batch)
            for batch in (1, 3)]
    assert {k: v.token_ids for k, v in runs[0].items()} == {k: v.token_ids for k, v in runs[1].items()}
    assert all(v.meter.compactions > 0 for v in runs[0].values())
