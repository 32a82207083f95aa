"""DeepSeek-V2/V3 checkpoints on the reference MLA: how `retention run` always decodes them.

transformers' own modules compute everything but attention: embeddings, norms, dense and MoE
MLPs, the rotary embedding (YaRN included) and the LM head. Attention is `MLAttention`, absorbed,
over the same weight tensors (shared, not copied), reading the layout cache (`RetentionCache.for_layout`) of the latent and the
RoPE key, with the checkpoint's softmax scale. So the scorers that read the attention a layout
model reports (`h2o`, `snapkv`: the absorbed queries' attention against the latent) run on a real
MLA checkpoint through `retention.runtime.engine`, and at full cache its logits equal transformers' (tests).

Shapes: batch `B`, heads `h`, new tokens `q`, RoPE dims `d`.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import torch
from torch import nn

from retention.models.arch.configs import ArchConfig
from retention.models.arch.model import ArchOutput, LayoutLM
from retention.models.arch.modules import MLAttention
from retention.errors import RetentionError

SUPPORTED = ("deepseek_v2", "deepseek_v3")
# The attention submodules `MLAttention` reads, by transformers' names (the same as ours).
_SHARED = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
           "o_proj")


def _rotation(hf_model):
    """The checkpoint's rotary embedding as `rotate(x [B, h, q, d], pos [B, q]) -> x` (the modeling
    module's own rotation: complex pairs for V2, interleaved or half-split cos/sin for V3)."""
    modeling = importlib.import_module(type(hf_model).__module__)
    rotary = hf_model.model.rotary_emb
    if hf_model.config.model_type == "deepseek_v2":
        return lambda x, pos: modeling.apply_rotary_emb(x, x, rotary(x, pos))[0]
    interleave = getattr(hf_model.config, "rope_interleave", False)
    apply = modeling.apply_rotary_pos_emb_interleave if interleave else modeling.apply_rotary_pos_emb
    return lambda x, pos: apply(x, x, *rotary(x, pos))[0]


def _arch_config(c) -> ArchConfig:
    return ArchConfig("mla", layers=c.num_hidden_layers, hidden=c.hidden_size, q_heads=c.num_attention_heads,
                      kv_heads=1, vocab=c.vocab_size, ffn=c.intermediate_size, latent_dim=c.kv_lora_rank,
                      rope_dim=c.qk_rope_head_dim, nope_dim=c.qk_nope_head_dim, v_dim=c.v_head_dim,
                      q_lora_rank=c.q_lora_rank or 0, norm_eps=c.rms_norm_eps)


class DeepseekReference(LayoutLM):
    """A transformers `DeepseekV2ForCausalLM`/`DeepseekV3ForCausalLM` decoded on the reference MLA."""

    def __init__(self, hf_model):
        super().__init__()
        model_type = getattr(hf_model.config, "model_type", None)
        if model_type not in SUPPORTED:
            raise RetentionError(f"the reference MLA runs DeepSeek-V2/V3 checkpoints, not {model_type!r}")
        self.hf = hf_model
        self.config = _arch_config(hf_model.config)
        rotate = _rotation(hf_model)
        attention = []
        for i, layer in enumerate(hf_model.model.layers):
            with torch.device("meta"):  # no weights of its own: every submodule is the checkpoint's
                attn = MLAttention(self.config, i)
            for name in _SHARED:
                if hasattr(attn, name):
                    setattr(attn, name, getattr(layer.self_attn, name))
            attn.scaling, attn.rotate = layer.self_attn.scaling, rotate
            attention.append(attn)
        self.attention = nn.ModuleList(attention)
        assert not any(p.is_meta for p in self.parameters()), "an MLA weight was not taken from the checkpoint"

    @property
    def generation_config(self):
        return self.hf.generation_config

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache,
                logits_to_keep: int = 0) -> ArchOutput:
        """input_ids, position_ids `[B, q]` (absolute positions) -> logits `[B, q or logits_to_keep, V]`."""
        cache.begin_step(position_ids)
        body = self.hf.model
        x = body.embed_tokens(input_ids)
        for layer, attn in zip(body.layers, self.attention, strict=True):
            x = x + attn(layer.input_layernorm(x), position_ids, cache)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = body.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return ArchOutput(self.hf.lm_head(x))


def on_reference_mla(loaded):
    """`loaded` (a `retention.models.LoadedModel`) with a DeepSeek-V2/V3 checkpoint's model decoded
    on the reference MLA (the cache layout is unchanged: the latent and the RoPE key); any other
    model as it is."""
    if getattr(getattr(loaded.model, "config", None), "model_type", None) not in SUPPORTED:
        return loaded
    return replace(loaded, model=DeepseekReference(loaded.model).eval())
