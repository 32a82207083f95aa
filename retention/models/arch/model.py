"""`ArchLM`: a causal LM of pre-RMSNorm blocks (attention of one layout family + SwiGLU), untied
embeddings, decoding through the layout cache (`RetentionCache.for_layout`) with explicit absolute positions; and the parameter
counts of the documented configurations (`count_parameters`, `documented_parameters`), which need
the model and so live here, not in `retention.models.arch.configs` (that module imports nothing from this one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from retention.models.arch.configs import DOCUMENTED_CONFIGS, DOCUMENTED_PARAMETERS, PARAMETER_NOTES, TINY, ArchConfig
from retention.models.arch.modules import ATTENTION, RMSNorm
from retention.runtime.cache import RetentionCache


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.self_attn = ATTENTION[cfg.family](cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.ffn)

    def forward(self, x, pos, cache):
        x = x + self.self_attn(self.input_layernorm(x), pos, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)


@dataclass
class ArchOutput:
    logits: torch.Tensor  # [B, q, vocab]


class LayoutLM(nn.Module):
    """A reference layout model as `retention.runtime.engine` decodes it: `forward(input_ids, position_ids,
    cache, logits_to_keep)` on a `RetentionCache.for_layout(cache_layout())`; its modules report
    their attention probabilities through the cache (`reports_attention`)."""

    config: ArchConfig
    reports_attention = True

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def cache_layout(self):
        """The `CacheLayout` this model stores, in its dtype."""
        return self.config.cache_layout().with_dtype(self.dtype)

    def new_cache(self, capacity: int = 0) -> RetentionCache:
        """An empty cache of this model's layout; `capacity` tokens preallocated per store."""
        return RetentionCache.for_layout(self.cache_layout(), capacity or None)


class ArchLM(LayoutLM):
    """Parameter names match transformers' Llama/DeepSeek-V2 causal LMs (`model.layers.N.self_attn...`)."""

    def __init__(self, config: ArchConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_absorb(self, absorb: bool) -> None:
        """Absorbed (latent) or materialised keys/values in every MLA layer."""
        for block in self.model.layers:
            if hasattr(block.self_attn, "absorb"):
                block.self_attn.absorb = absorb

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: RetentionCache,
                logits_to_keep: int = 0) -> ArchOutput:
        """input_ids, position_ids `[B, q]` (absolute positions) -> logits `[B, q or logits_to_keep, V]`."""
        cache.begin_step(position_ids)
        x = self.model.embed_tokens(input_ids)
        for block in self.model.layers:
            x = block(x, position_ids, cache)
        x = self.model.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return ArchOutput(self.lm_head(x))


def is_arch_model(model) -> bool:
    """Whether `model` decodes on the reference modules (a layout cache)."""
    return isinstance(model, LayoutLM)


def init_weights(model: ArchLM, seed: int) -> ArchLM:
    """Seeded normal(0, init_range) weights, unit norms; the caller's RNG state is left alone."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, model.config.init_range)
    return model


def build_arch(name_or_config: str | ArchConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> ArchLM:
    """A tiny random `ArchLM` by name (`TINY`) or from a config, eval mode, on the CPU."""
    config = TINY[name_or_config] if isinstance(name_or_config, str) else name_or_config
    return init_weights(ArchLM(config), seed).to(dtype).eval()


def count_parameters(config: ArchConfig) -> int:
    """Parameters of `ArchLM(config)`, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = ArchLM(config)
    return sum(p.numel() for p in model.parameters())


def documented_parameters(name: str) -> dict:
    """`parameters` (counted from the module) and `parameters_documented` for a documented layout
    that has a configuration, with a note where part of the configuration is derived; `{}` otherwise."""
    if name not in DOCUMENTED_CONFIGS:
        return {}
    out = {"parameters": count_parameters(DOCUMENTED_CONFIGS[name]),
           "parameters_documented": DOCUMENTED_PARAMETERS[name]}
    if name in PARAMETER_NOTES:
        out["parameters_note"] = PARAMETER_NOTES[name]
    return out
