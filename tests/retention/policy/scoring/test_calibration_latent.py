"""Latent query statistics of MLA models (`retention.policy.scoring.calibration_latent`, `retention calibrate`):
known values, the save/load round trip, one-line refusals of another model's or kind's file, the
CLI on tiny-mla and its refusals, and the conventions (band pairings, the key norm's weight, the
cached inverse RMS, YaRN's attention factor) checked against each model's own attention logit:
with the statistics of one query and the offset 0, the latent score times the softmax scale is
that query's logit (reference MLA, QK-norm MLA, DeepSeek-V2 and -V3 checkpoints)."""

from __future__ import annotations

import pytest
import torch
import transformers
from click.testing import CliRunner

from retention.models.arch.configs import ArchConfig
from retention.models.arch.deepseek import DeepseekReference
from retention.models.arch.model import build_arch
from retention.models.arch.modules import _heads, rope
from retention.policy.scoring.calibration import QueryStats, calibrate, load_stats, tokens_sha256
from retention.policy.scoring.calibration_latent import LatentStats, calibrate_latent, latent_model, load_latent_stats
from retention.errors import RetentionError
from retention.policy.scoring.latent import latent_triattention_scores, rope_bands

IDS = torch.randint(0, 259, (150,), generator=torch.Generator().manual_seed(3))


def direct_stats(model, ids, chunk):
    """The statistics computed without hooks on the projections: each layer's attention input `x`
    (a pre-hook), its query `q_proj(x)` split per head, the norms applied for QK-norm MLA."""
    cfg, xs = model.config, {}
    handles = [b.self_attn.register_forward_pre_hook(lambda m, a, i=i: xs.setdefault(i, []).append(a[0]))
               for i, b in enumerate(model.model.layers)]
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            part = ids[s:s + chunk][None]
            model(part, torch.arange(part.shape[1])[None], model.new_cache())
    for h in handles:
        h.remove()
    out = {k: [] for k in ("qm", "qa", "cm", "ca")}
    for i, block in enumerate(model.model.layers):
        attn = block.self_attn
        with torch.no_grad():
            q = torch.cat([_heads(attn.q_proj(x), cfg.q_heads)[0] for x in xs[i]], 1).transpose(0, 1)  # [T, H, d]
            qn, qr = q.split([cfg.nope_dim, cfg.rope_dim], -1)
            if cfg.family == "qk-norm-mla":
                qn, qr = attn.q_norm(qn), attn.q_rope_norm(qr)
        z = torch.complex(qr[..., 0::2].double(), qr[..., 1::2].double())
        out["qm"].append(z.mean(0))
        out["qa"].append(z.abs().mean(0))
        out["cm"].append(qn.double().mean(0))
        out["ca"].append(qn.double().abs().mean(0))
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-qk-norm-mla"])
def test_statistics_equal_direct_computation(name):
    model = build_arch(name, dtype=torch.float64)
    st = calibrate_latent(model, IDS, chunk=64, model_id=name)
    want = direct_stats(model, IDS, 64)
    L, H, c = model.config.layers, model.config.q_heads, model.config
    assert st.rope_qm.shape == st.rope_qa.shape == (L, H, c.rope_dim // 2)
    assert st.content_mean.shape == st.content_qa.shape == (L, H, c.nope_dim)
    torch.testing.assert_close(st.rope_qm, want["qm"].to(torch.complex64), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st.rope_qa, want["qa"].float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st.content_mean, want["cm"].float(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st.content_qa, want["ca"].float(), rtol=1e-6, atol=1e-7)
    assert (st.rope_qa >= st.rope_qm.abs() - 1e-6).all() and st.content_mean.abs().max() > 0.1
    assert st.meta["kind"] == "latent" and st.meta["tokens"] == 150 and st.meta["tokens_sha256"] == tokens_sha256(IDS)
    assert st.meta["geometry"]["family"] == model.config.family


def test_round_trip_and_refusals(tmp_path):
    mla = build_arch("tiny-mla")
    st = calibrate_latent(mla, IDS, model_id="tiny-mla")
    path = st.save(tmp_path / "mla.safetensors")
    back = load_latent_stats(path, mla)
    for a, b in ((st.rope_qm, back.rope_qm), (st.rope_qa, back.rope_qa), (st.content_mean, back.content_mean),
                 (st.content_qa, back.content_qa), (st.inv_freq, back.inv_freq)):
        assert torch.equal(a, b)
    assert back.meta == st.meta
    # Another model of the same shapes (QK-norm), and another layer count: one line naming the difference.
    with pytest.raises(RetentionError, match=r"family 'mla' vs model 'qk-norm-mla'.*retention calibrate"):
        load_latent_stats(path, build_arch("tiny-qk-norm-mla"))
    three = build_arch(ArchConfig("mla", layers=3, latent_dim=24, rope_dim=8, nope_dim=16, v_dim=16))
    with pytest.raises(RetentionError, match="layers 4 vs model 3"):
        load_latent_stats(path, three)
    # Files of the other kind, each way.
    from retention.models import build_tiny_random

    tiny = build_tiny_random()[0].eval()
    head = calibrate(tiny, IDS[:64]).save(tmp_path / "head.safetensors")
    with pytest.raises(RetentionError, match="holds per-head query statistics"):
        load_latent_stats(head, mla)
    with pytest.raises(RetentionError, match=r"holds latent \(MLA\) statistics"):
        load_stats(path, tiny)
    with pytest.raises(RetentionError, match="no calibration statistics at"):
        load_latent_stats(tmp_path / "missing.safetensors", mla)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(RetentionError, match="not a retention statistics file"):
        LatentStats.load(tmp_path / "junk.safetensors")
    assert latent_model(tiny) is None and latent_model(build_arch("tiny-kv")) is None


def test_calibrate_cli_on_tiny_mla_and_the_default_location(tmp_path, monkeypatch):
    from retention.cli import main
    from retention.models import build_tiny_tokenizer
    from retention.policy.registry import make_scorer

    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "calib.txt"
    text.write_text("Let x = 3. Then x + 4 = 7, so the answer is 7. " * 8, encoding="utf-8")
    res = CliRunner().invoke(main, ["calibrate", "--model", "tiny-mla", "--text", str(text), "--tokens", "200"])
    assert res.exit_code == 0, res.output
    assert "(MLA latent)" in res.output
    model = build_arch("tiny-mla")
    st = load_latent_stats(None, model)  # the default location, found by the model's name
    ids = build_tiny_tokenizer()(text.read_text())["input_ids"][:200]
    assert st.meta["tokens_sha256"] == tokens_sha256(ids) and st.meta["model_id"] == "tiny-mla"
    torch.testing.assert_close(st.content_mean, calibrate_latent(model, ids).content_mean)
    scorer = make_scorer("triattention")  # no --stats: the default location
    with scorer.attach(model):
        assert scorer._latent is not None
    for name, why in (("tiny-cla", "shared by several layers"), ("tiny-path-mla", "not implemented"),
                      ("tiny-path-concat", "several layers")):
        bad = CliRunner().invoke(main, ["calibrate", "--model", name, "--text", str(text)])
        assert bad.exit_code != 0 and "Traceback" not in bad.output, bad.output
        lines = [ln for ln in bad.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and why in lines[0], bad.output
    with pytest.raises(RetentionError, match="no calibration statistics at .*tiny-qk-norm-mla.*retention calibrate "
                                             "--model tiny-qk-norm-mla"):
        load_latent_stats(None, build_arch("tiny-qk-norm-mla"))


# --------------------------------------------------------------------------------------------
# The conventions, against each model's own logit
# --------------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# Without mscale_all_dim, YaRN's attention factor (1 + 0.1 ln 4) multiplies the rotated q and k.
YARN_FACTOR = dict(YARN, mscale_all_dim=0.0)
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}


def deepseek(version: str, q_lora_rank=None, rope=DEFAULT_ROPE, interleave: bool = True):
    """A seeded random 2-layer DeepSeek-V2/V3 causal LM (dense MLPs), float64."""
    prefix = "DeepseekV2" if version == "v2" else "DeepseekV3"
    extra = {} if version == "v2" else {"n_group": 1, "topk_group": 1, "rope_interleave": interleave}
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=259, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_parameters=rope, initializer_range=0.2, attn_implementation="eager", **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return getattr(transformers, f"{prefix}ForCausalLM")(config).eval().double()


CASES = {
    "tiny-mla": lambda: build_arch("tiny-mla", dtype=torch.float64),
    "tiny-qk-norm-mla": lambda: build_arch("tiny-qk-norm-mla", dtype=torch.float64),
    "v2": lambda: deepseek("v2"),
    "v2-yarn": lambda: deepseek("v2", rope=YARN),
    "v2-yarn-attention-factor": lambda: deepseek("v2", rope=YARN_FACTOR),
    "v3-yarn-attention-factor": lambda: deepseek("v3", None, YARN_FACTOR, True),
    "v3-yarn-interleaved-qlora": lambda: deepseek("v3", 16, YARN, True),
    "v3-half-split": lambda: deepseek("v3", None, DEFAULT_ROPE, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_query_statistics_give_the_models_logit(case):
    """Statistics of the single query at position `t` (its own mean, modulus = |mean|), offset 0:
    `score * scale` equals the logits of that query against the cache, computed materialised with
    the model's own rotation, norms and up-projections."""
    model = CASES[case]()
    latent = latent_model(model)
    ref = model if isinstance(model, torch.nn.Module) and hasattr(model, "new_cache") else DeepseekReference(model)
    layer, T, H = 1, 13, latent.q_heads
    attn = latent.attention[layer]
    proj = attn.q_b_proj if getattr(attn, "q_b_proj", None) is not None else attn.q_proj
    seen = []
    handle = proj.register_forward_hook(lambda m, a, out: seen.append(out))
    ids = torch.randint(0, 259, (1, T), generator=torch.Generator().manual_seed(4))
    cache = ref.new_cache()
    with torch.no_grad():
        ref(ids, torch.arange(T)[None], cache)
    handle.remove()
    t = T - 1
    q_nope, q_rope = _heads(seen[0][:, t:t + 1], H)[0, :, 0].split([latent.nope_dim, latent.rope_dim], -1)  # [H, *]
    c, kr = cache.read(f"L{layer}.c_kv")[0, 0], cache.read(f"L{layer}.k_rope")[0, 0]  # [n, r], [n, d_r]
    pos = torch.tensor([[t]])
    with torch.no_grad():
        if latent.family == "qk-norm-mla":
            q_nope, q_rope = attn.q_norm(q_nope), attn.q_rope_norm(q_rope)
            g = latent.kv_groups
            k_nope = attn.k_norm(torch.einsum("nc,gec->gne", c, attn.k_b_proj.weight.view(g, latent.nope_dim, -1)))
            k_nope = k_nope.repeat_interleave(H // g, 0)
            q_rot = rope(q_rope[None, :, None], pos, model.config.rope_theta)[0, :, 0]
            scale = (latent.nope_dim + latent.rope_dim) ** -0.5
        else:
            k_nope = torch.einsum("nc,hec->hne", c, attn.up_weights()[0])
            q_rot = attn._rope(q_rope[None, :, None], pos)[0, :, 0]
            scale = attn.scaling
        logits = (torch.einsum("he,hne->hn", q_nope, k_nope) + q_rot @ kr.T) * scale
    re, im = rope_bands(q_rope, latent.query_interleaved)
    qm = torch.complex(re, im)
    w_uk_t, _ = latent.up_weights(layer)
    rho = cache.read(f"L{layer}.inv_rms")[0] if latent.family == "qk-norm-mla" else None  # [G, n, 1]
    got = latent_triattention_scores(c[None], kr[None], t, qm, qm.abs(), latent.inv_freq, q_nope, w_uk_t,
                                     content_qa=q_nope.abs(), content_factor=None if rho is None else rho[None, ..., 0],
                                     offsets=(0,), interleaved=latent.key_interleaved, rope_scale=latent.rope_scale)
    err = ((got[0] * scale - logits).abs().max() / logits.abs().max()).item()
    # float32 RoPE frequencies (as the models compute them) limit the agreement, not the derivation.
    assert err < 1e-6, err
    assert logits.std() > 0.05
    if "factor" in case:  # the case tests the factor only if there is one
        assert latent.rope_scale > 1.1
    if case.startswith("v"):  # and the checkpoint calibrates with the conventions used above
        st = calibrate_latent(model, IDS[:40], model_id=case)
        assert st.meta["geometry"]["query_interleaved"] == latent.query_interleaved
        assert st.rope_qm.shape == (2, H, latent.rope_dim // 2) and st.content_mean.abs().max() > 0


def test_a_file_that_is_not_safetensors_is_one_error_line(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"not a file at all")
    for load in (LatentStats.load, QueryStats.load):
        with pytest.raises(RetentionError, match="not a retention statistics file"):
            load(tmp_path / "junk.safetensors")


def test_calibrate_cli_on_a_deepseek_checkpoint_folder(tmp_path):
    from retention.cli import main
    from retention.models import build_tiny_tokenizer

    folder = tmp_path / "ds"
    model = deepseek("v3", 16, YARN_FACTOR, True).float()
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    text = tmp_path / "calib.txt"
    text.write_text("Compute 12 * 7 = 84 and 84 / 4 = 21. " * 6, encoding="utf-8")
    out = tmp_path / "ds.safetensors"
    res = CliRunner().invoke(main, ["calibrate", "--model", str(folder), "--text", str(text), "--tokens", "100",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "2 layers x 4 query heads (MLA latent)" in res.output
    st = load_latent_stats(out, model)  # checked against the checkpoint (geometry, pairings, YaRN factor)
    geometry = st.meta["geometry"]
    assert geometry["query_interleaved"] and not geometry["key_interleaved"] and geometry["rope_scale"] > 1.1
    with pytest.raises(RetentionError, match="rope_scale"):
        load_latent_stats(out, deepseek("v3", 16, YARN, True).float())
