"""The engine's model adapter: what `retention.runtime.engine` needs from a model, for transformers models and
the reference layout models (`retention.models.arch`, DeepSeek checkpoints on the reference MLA) alike.

* one step forward at explicit absolute positions (`forward`): transformers get a 4-D additive mask
  that hides each row's padding (per query head on a ragged cache, rewritten by the cache for each
  layer: `retention.runtime.cache`); the layout modules mask padding by position (`PAD`);
* the cache it writes (`new_cache`): the per-layer K/V layout of `RetentionCache`, or the model's
  `CacheLayout` (`RetentionCache.for_layout`), which collects the attention the modules report when
  the scorer reads it;
* what it provides to scorers (`provides`, kinds of `retention.policy.registry.READS`): beyond the stores,
  `queries`/`calibration` through `retention.runtime.capture` on transformers, `attention` on the layout
  modules.
"""

from __future__ import annotations

import inspect

import torch

from retention.runtime.cache import RetentionCache

# What each kind of model provides to a scorer (`retention.policy.registry.READS`).
TRANSFORMERS_PROVIDES = frozenset({"positions", "keys", "values", "queries", "calibration"})
LAYOUT_MODEL_PROVIDES = frozenset({"positions", "attention"})


def provides(layout, reference: bool) -> frozenset[str]:
    """What a model with cache `layout` gives scorers: a transformers model its per-layer K/V
    (`keys`, `values`) and the queries it computes (`queries`, so `calibration` too); a reference
    layout model (`reference`) the attention its modules report, plus the layout's stores the
    view exposes (`CacheLayout.provides`: a `latent` on MLA; per-head keys reach scorers only on
    the transformers path); on an MLA latent also `calibration`, the latent query statistics of
    `retention.policy.scoring.calibration_latent` (not on path-on-MLA: not implemented there)."""
    if not reference:
        return TRANSFORMERS_PROVIDES
    calibrated = {"calibration"} if layout.family == "mla" else set()
    return LAYOUT_MODEL_PROVIDES | (layout.provides & {"latent"}) | calibrated


def cache_kwarg(model) -> str:
    """transformers is renaming the forward's cache argument (`past_key_values` -> `cache`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_step(model, input_ids: torch.Tensor, positions: torch.Tensor, cache, cache_kw: str,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of `[R, q]` tokens at explicit absolute positions; returns the last logits `[R, V]`."""
    if getattr(model, "reports_attention", False):  # a reference layout model (`retention.models.arch`)
        return model(input_ids, positions, cache, logits_to_keep=1).logits[:, -1]
    if isinstance(cache, RetentionCache):
        cache.set_step_positions(positions)
    kw = {} if attention_mask is None else {"attention_mask": attention_mask}
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_kw: cache},
                **kw)
    return out.logits[:, -1]


class ModelAdapter:
    """What the engine needs from a model: one step forward at explicit positions (`forward`), the
    cache it writes (`new_cache`: its `CacheLayout`) and what it provides to scorers (`provides`)."""

    def __init__(self, model):
        self.model = model
        self.reference = bool(getattr(model, "reports_attention", False))
        self.cache_kw = None if self.reference else cache_kwarg(model)
        self.dtype = next(model.parameters()).dtype
        self.layout = model.cache_layout() if self.reference else None
        text = None if self.reference else model.config.get_text_config()
        self.L = self.layout.layers if self.reference else text.num_hidden_layers
        self.query_heads = 1 if self.reference else text.num_attention_heads
        self.provides = provides(self.layout, self.reference)

    def new_cache(self, capacity: int | None, reader=None) -> RetentionCache:
        """An empty cache of the model's layout; with `reader` (anything with `reading()`: the run's
        policy, or a scorer), one that collects the attention the modules report when it is read."""
        if not self.reference:
            return RetentionCache(self.L, capacity=capacity)
        cache = RetentionCache.for_layout(self.layout, capacity)
        cache.collect_attention = reader is not None and "attention" in self.provides and any(
            "attention" in alt for alt in reader.reading())
        return cache

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: RetentionCache, padded: bool = False) -> torch.Tensor:
        """Logits `[R, V]` of one forward of `[R, q]` tokens; `padded`: rows may differ in length (a
        ragged cache, whose heads differ in length, always gets its per-head mask)."""
        if self.reference:
            return self.model(ids, pos, cache, logits_to_keep=1).logits[:, -1]
        mask = cache.attention_mask(1, self.dtype, self.query_heads) if padded or cache.ragged else None
        return forward_step(self.model, ids, pos, cache, self.cache_kw, mask)
