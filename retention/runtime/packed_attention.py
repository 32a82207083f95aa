"""Attention over a packed quantised store (`retention.runtime.packed_kv`), dequantised on the fly.

Shapes: rows `S`, query heads `Hq`, KV heads `G` (query head `h` reads KV head `h // (Hq / G)`),
queries `q`, head dims `dk`/`dv`, ring entries `F`, view width `w`, chunk `c <= CHUNK`.

The side channel: a packed group's `update` returns, instead of its keys and values, two
*handles* (`handle`): one-element NaN tensors expanded to `[S, G, w, d]` (no memory; the shape
transformers' mask code reads) carrying the group (`handle.packed_layer`). transformers hands them
unchanged to the attention function registered under the model's implementation name; inside
`packed_attention(model)` that name is `PACKED_NAME` (`retention_packed` for `sdpa`,
`retention_packed_<impl>` otherwise), whose function runs `attend` when its key is a handle and the
model's original implementation otherwise (a plain cache: a prefill, the fidelity reference). A
handle that reaches any other attention makes NaN logits, never a plausible wrong token.

`attend` reads the ring (the full-precision tokens) and then the token axis in chunks of `CHUNK`
tokens: each chunk's codes are unpacked and dequantised (float32, not rounded to the model's dtype:
a bfloat16 model's attention reads them a rounding more exactly than the view, which rounds them, and
the simulated store, which holds them rounded), scored, and merged into a running log-sum-exp (online softmax: running
max `m`, denominator `l`, output `o`, all in float32, float64 on a float64 model), so no step holds
more than a chunk of dequantised keys and values. Masking is by the store itself, not the mask
transformers passes: a token-axis entry counts where it is within its row's width, not a hole
(position >= 0), quantised (`slot > 0`: full-precision tokens are read from the ring) and not after
the query (position <= the query's); a ring entry where it holds a token (`ring_pos >= 0`) not
after the query. Rows whose every key is masked (a padding row) give zeros.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from retention.errors import RetentionError
from retention.runtime.capture import CAPTURE_NAME, _eager_for
from retention.runtime.packed_kv import CHUNK, PackedKV, codes_kv

PACKED_NAME = "retention_packed"
_REGISTERED: dict[str, str] = {}  # packed name -> the original implementation it delegates to
_HANDLE_VALUE = float("nan")


def handle(layer, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-memory `[S, G, w, d]` stand-in for a packed group's keys or values (module doc)."""
    h = torch.full((1,), _HANDLE_VALUE, dtype=dtype, device=device).expand(*shape)
    h.packed_layer = layer
    return h


def _merge(m, l, o, s, valid, v):
    """One online-softmax step: scores `s` `[S, G, r, c]` (masked by `valid`), values `v` `[S, G, c, dv]`."""
    s = s.masked_fill(~valid, -math.inf)
    m_new = torch.maximum(m, s.amax(-1))
    base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # nothing valid yet: no shift
    scale = torch.exp(m - base)
    p = torch.exp(s - base[..., None])
    return m_new, l * scale + p.sum(-1), o * scale[..., None] + p @ v


def attend(query: torch.Tensor, layer, scaling: float) -> torch.Tensor:
    """The attention output `[S, q, Hq, dv]` (query's dtype) of `query` `[S, Hq, q, dk]` over packed
    group `layer` (module doc)."""
    pk: PackedKV = layer.packed
    acc = pk.spec.acc
    S, Hq, q, dk = query.shape
    G = pk.ring_pos.shape[1]
    r = Hq // G
    qf = query.to(acc).reshape(S, G, r * q, dk)
    qpos = pk.step_pos.to(pk.ring_pos.device)  # [S, q]
    qp = qpos[:, None, :].expand(S, r, q).reshape(S, 1, r * q)  # [S, 1, rq]: each query row's position
    dv = pk.ring_v.shape[-1]
    m = torch.full((S, G, r * q), -math.inf, dtype=acc, device=query.device)
    l = torch.zeros(S, G, r * q, dtype=acc, device=query.device)
    o = torch.zeros(S, G, r * q, dv, dtype=acc, device=query.device)
    # The ring: the tokens still in full precision.
    s = (qf @ pk.ring_k.to(acc).transpose(-1, -2)) * scaling  # [S, G, rq, F]
    rp = pk.ring_pos[:, :, None, :]
    m, l, o = _merge(m, l, o, s, (rp >= 0) & (rp <= qp[..., None]), pk.ring_v.to(acc))
    # The token axis, `CHUNK` tokens at a time: the quantised tokens.
    w = layer.positions.shape[-1]
    widths = pk.step_widths
    slot_b, pos_b = layer.stores["slot"], layer.pbuf
    for c0 in range(0, w, CHUNK):
        c1 = min(w, c0 + CHUNK)
        k, v = codes_kv(layer, lambda b: b[:, :, c0:c1], lambda b: b)  # [S, G, c, d] float32
        pos = pos_b[:, :, c0:c1]
        ok = (slot_b[:, :, c0:c1] > 0) & (pos >= 0) & \
             (torch.arange(c0, c1, device=pos.device)[None, None, :] < widths[:, None, None])  # [S, G, c]
        s = (qf @ k.to(acc).transpose(-1, -2)) * scaling
        valid = ok[:, :, None, :] & (pos[:, :, None, :] <= qp[..., None])
        m, l, o = _merge(m, l, o, s, valid, v.to(acc))
    out = torch.where(l[..., None] > 0, o / l.clamp(min=torch.finfo(acc).tiny)[..., None], 0.0)
    return out.view(S, G, r, q, dv).reshape(S, Hq, q, dv).transpose(1, 2).to(query.dtype)


def _make_fn(original: str) -> Callable:
    # deferred: transformers.modeling_utils adds ~1.3 s to CLI start-up (the CLI imports this module)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def packed_attention_fn(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
        layer = getattr(key, "packed_layer", None)
        if layer is None:  # a plain cache (prefill, the fidelity reference): the original, unchanged
            fn = _eager_for(module) if original == "eager" else ALL_ATTENTION_FUNCTIONS[original]
            return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        for what in ("sliding_window", "softcap"):  # attention this function does not compute: refused, not ignored
            if kwargs.get(what) is not None:
                raise RetentionError(f"the packed quant store has no attention with {what}; use quant.store=simulated")
        if scaling is None:
            scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
        return attend(query, layer, float(scaling)), None

    packed_attention_fn.__doc__ = f"A packed group's chunked attention; `{original}` for any other cache."
    return packed_attention_fn


def packed_name(original: str) -> str:
    """Register (once) the packed attention and mask functions that stand in for `original`."""
    # deferred: transformers.modeling_utils adds ~1.3 s to CLI start-up (the CLI imports this module)
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = PACKED_NAME if original == "sdpa" else f"{PACKED_NAME}_{original}"
    if name not in _REGISTERED:
        if original != "eager" and original not in AttentionInterface._global_mapping:
            raise RetentionError(f"no packed attention for attention implementation {original!r}")
        AttentionInterface.register(name, _make_fn(original))
        mask_fn = AttentionMaskInterface._global_mapping.get(original)
        if mask_fn is not None:  # the plain path's masks stay what the original builds
            AttentionMaskInterface.register(name, mask_fn)
        _REGISTERED[name] = original
    return name


@contextlib.contextmanager
def packed_attention(model) -> Iterator[None]:
    """Run `model`'s attention through the packed-store function inside the context (restored on
    exit); a no-op for a model without a switchable implementation (a reference layout model,
    which a packed store never runs on) or one already switched."""
    config = getattr(model, "config", None)
    original = getattr(config, "_attn_implementation", None)
    if original is None or original.startswith(PACKED_NAME) or not hasattr(model, "set_attn_implementation"):
        yield
        return
    if original.startswith(CAPTURE_NAME):
        raise RetentionError("switch to the packed attention before capturing queries (the policy's attach does)")
    name = packed_name(original)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
