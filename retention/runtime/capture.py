"""Recording the post-RoPE queries a model computes, without patching any model class.

Scorers that look at attention (SnapKV, R-KV, H2O) need the queries exactly as the model computed
them at each step (after RoPE at their own positions, seen against the cache of that step). This
module is the project's one mechanism for getting them:

* transformers dispatches every attention call through the `AttentionInterface` registry, looked up
  by name with `config._attn_implementation`. On first use `capture_queries` registers, under a new
  name (`retention_capture` when the model runs `sdpa`, `retention_capture_<impl>` otherwise), a
  function that records `(layer, query, key, scaling)` and then calls the model's original
  implementation with the same arguments. It also registers the original's mask function under the
  same name in `AttentionMaskInterface`: transformers builds no causal mask at all for an attention
  name it has no mask function for, so without this the prefill would silently attend to the future.
  Registering adds names; no existing entry and no model class is modified.
* `capture_queries(model)` switches the model to that name with `model.set_attn_implementation`
  only inside the context, and restores the previous implementation on exit, exceptions included.

Because the recording function hands the very same tensors to the very same kernel, the model's
outputs are bit-identical with and without capture (a test holds this).

Which cache a recorded call belongs to: a step may run more than one forward (generation with
`fidelity=True` also decodes through a reference `DynamicCache`). `QueryRecorder.take(cache)` returns,
per layer, the last call whose keys are that cache's stored keys (the attention receives the tensor
the cache's `update` returned, so storage pointer and shape identify it); other calls are dropped.

Shapes: batch `B`, query heads `Hq`, new tokens `q`, head dim `d`, stored tokens `n`, KV heads `G`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from retention.errors import RetentionError

CAPTURE_NAME = "retention_capture"
# Attention calls remembered per layer between two `take`s: enough for the retained forward plus a
# reference forward in the same step, each run twice on a step where the engine's tail narrows its
# rows, bounded so a recorder nobody reads cannot grow without limit.
MAX_PENDING = 4

# Recorder of every model currently capturing, keyed by the id of the config its attention modules read.
_ACTIVE: dict[int, QueryRecorder] = {}
_REGISTERED: dict[str, str] = {}  # capture name -> original implementation it delegates to


@dataclass
class CapturedCall:
    """One attention call: `query` `[B, Hq, q, d]` post-RoPE, `key` `[B, G, n, d]` as the attention saw
    it (for matching only), `scaling` the softmax scale the model used."""

    query: torch.Tensor
    key: torch.Tensor
    scaling: float


class QueryRecorder:
    """Per-layer attention calls recorded while `capture_queries` is active; read with `take`."""

    def __init__(self) -> None:
        self._pending: dict[int, list[CapturedCall]] = {}

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        calls = self._pending.setdefault(layer, [])
        calls.append(CapturedCall(query, key, scaling))
        if len(calls) > MAX_PENDING:
            del calls[0]

    def take(self, cache) -> list[CapturedCall]:
        """The last call of every layer of `cache` whose keys are that layer's stored keys; clears all.

        cache: any transformers `Cache` with `layers[i].keys` `[B, G, n, d]` (a `RetentionCache`).
        Raises `RuntimeError` when a layer has no matching call (the forward did not run through
        this recorder, e.g. `take` called twice for one forward).
        """
        out = []
        for i, layer in enumerate(cache.layers):
            keys = layer.keys
            match = None
            for call in reversed(self._pending.get(i, [])):
                if call.key is keys or (call.key.data_ptr() == keys.data_ptr() and call.key.shape == keys.shape):
                    match = call
                    break
            if match is None:
                raise RuntimeError(f"no recorded attention call of layer {i} matches the cache's stored keys")
            out.append(match)
        self._pending.clear()
        return out

    def clear(self) -> None:
        self._pending.clear()


def _eager_for(module) -> Callable:
    """The `eager_attention_forward` of the module's own modeling file (models define their own)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        # deferred: transformers.modeling_utils adds ~1.3 s to CLI start-up (the CLI imports this module)
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def attention_function(module) -> Callable:
    """The attention function `module`'s forward calls under its config's implementation, the
    original one where that is a recording name of this module (so a call records nothing)."""
    # deferred: transformers.modeling_utils adds ~1.3 s to CLI start-up (the CLI imports this module)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module.config._attn_implementation
    impl = _REGISTERED.get(impl, impl)
    return _eager_for(module) if impl in (None, "eager") else ALL_ATTENTION_FUNCTIONS[impl]


def _make_capture_fn(original: str) -> Callable:
    # deferred: transformers.modeling_utils adds ~1.3 s to CLI start-up (the CLI imports this module)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def capture_attention(module, query, key, value, attention_mask, **kwargs):
        rec = _ACTIVE.get(id(module.config))
        if rec is not None:
            scaling = kwargs.get("scaling")
            if scaling is None:
                scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
            rec.record(module.layer_idx, query, key, float(scaling))
        fn = _eager_for(module) if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
        return fn(module, query, key, value, attention_mask, **kwargs)

    capture_attention.__doc__ = f"Record the query, then run the `{original}` attention unchanged."
    return capture_attention


def register_standin(prefix: str, original: str, make_fn: Callable, refusal: str, registered: dict) -> str:
    """Register (once) an attention function standing in for implementation `original` under
    `prefix` (`prefix_original` but for sdpa), with `original`'s mask function, and return its name.
    `make_fn(original)` builds it; `registered` maps each stand-in name to its original. Shared by the
    query capture here and the packed store's attention (`retention.runtime.packed_attention`)."""
    # deferred: transformers.modeling_utils adds ~1.3 s to CLI start-up (the CLI imports this module)
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = prefix if original == "sdpa" else f"{prefix}_{original}"
    if name not in registered:
        if original != "eager" and original not in AttentionInterface._global_mapping:
            raise RetentionError(f"{refusal} under attention implementation {original!r}")
        AttentionInterface.register(name, make_fn(original))
        mask_fn = AttentionMaskInterface._global_mapping.get(original)
        if mask_fn is not None:  # an implementation without a mask function gets none here either
            AttentionMaskInterface.register(name, mask_fn)
        registered[name] = original
    return name


def _capture_name(original: str) -> str:
    """Register (once) the recording attention + mask functions that stand in for `original`."""
    return register_standin(CAPTURE_NAME, original, _make_capture_fn, "cannot capture queries", _REGISTERED)


@contextlib.contextmanager
def capture_queries(model) -> Iterator[QueryRecorder]:
    """Record every attention call of `model` inside the context; yields the `QueryRecorder`.

    The model's attention implementation is switched to the recording one and restored on exit
    (also when the body raises). Capturing twice at once on the same model is refused.
    """
    configs = {id(model.config): model.config}
    text = model.config.get_text_config()
    configs[id(text)] = text
    if any(k in _ACTIVE for k in configs):
        raise RetentionError("queries are already being captured on this model")
    original = model.config._attn_implementation
    if original is None or original.startswith(CAPTURE_NAME):
        raise RetentionError(f"cannot capture queries under attention implementation {original!r}")
    name = _capture_name(original)
    recorder = QueryRecorder()
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        model.set_attn_implementation(original)
        raise RetentionError(f"{type(model).__name__} does not allow switching its attention implementation; "
                             "it cannot be used with scorers that record queries")
    for k in configs:
        _ACTIVE[k] = recorder
    try:
        yield recorder
    finally:
        for k in configs:
            _ACTIVE.pop(k, None)
        recorder.clear()
        model.set_attn_implementation(original)
