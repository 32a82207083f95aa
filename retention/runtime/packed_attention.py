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

`attend` reads the token axis `CHUNK` tokens at a time, the ring (the full-precision tokens) with
the first chunk: each chunk's codes are unpacked and dequantised (float32, then rounded to the
model's dtype, as the view and the simulated store hold them) and attended by the CPU flash kernel
SDPA runs on a plain cache (elsewhere a plain softmax in float32, float64 on a float64 model), which
returns each block's log-sum-exp; blocks are merged by it, so no step holds more than a chunk of
dequantised keys and values, and a cache within one chunk is one kernel call over the ring and its
codes. Masking is by the store itself, not the mask transformers passes: a token-axis entry counts
where it is within its row's width, not a hole (position >= 0), quantised (`slot > 0`: full-precision
tokens are read from the ring) and not after the query (position <= the query's); a ring entry where
it holds a token (`ring_pos >= 0`) not after the query. Rows whose every key is masked (a padding
row) give zeros. In bfloat16 each block's output is rounded to bfloat16 before the merge (a cache
over one chunk: none), within a rounding of the single-softmax result.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from retention.errors import RetentionError
from retention.runtime.capture import CAPTURE_NAME, _eager_for, register_standin
from retention.runtime.packed_kv import CHUNK, PackedKV, codes_kv

PACKED_NAME = "retention_packed"
_REGISTERED: dict[str, str] = {}  # packed name -> the original implementation it delegates to
_HANDLE_VALUE = float("nan")


def handle(layer, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-memory `[S, G, w, d]` stand-in for a packed group's keys or values (module doc)."""
    h = torch.full((1,), _HANDLE_VALUE, dtype=dtype, device=device).expand(*shape)
    h.packed_layer = layer
    return h


# The CPU flash-attention kernel behind SDPA, with its log-sum-exp (None: another build; the manual path).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scaling: float, acc: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: `q` `[S, G, R, dk]`, `k`/`v` `[S, G, c, d]` (model dtype), `valid`
    `[S, G, 1 or R, c]` -> its normalised output `[S, G, R, dv]` and log-sum-exp `[S, G, R]` (`acc`;
    -inf where no key is valid). On a CPU the SDPA flash kernel (the one a plain cache's attention
    runs), elsewhere a plain softmax in `acc`."""
    none = ~valid.any(-1)  # [S, G, 1 or R]
    if q.device.type == "cpu" and _FLASH_CPU is not None:
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, -math.inf)
        out, lse = _FLASH_CPU(q, k, v, attn_mask=mask, scale=scaling)
        out, lse = out.to(acc), lse.to(acc)
    else:
        s = ((q.to(acc) @ k.to(acc).transpose(-1, -2)) * scaling).masked_fill(~valid, -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        out = p @ v.to(acc)
    return out.masked_fill(none[..., None], 0.0), lse.masked_fill(none.expand_as(lse), -math.inf)


def _merge(acc_out, acc_lse, out, lse):
    """Two normalised partial attentions over disjoint keys, merged by their log-sum-exps."""
    if acc_out is None:
        return out, lse
    new = torch.logaddexp(acc_lse, lse)
    base = torch.where(torch.isinf(new), 0.0, new)
    a, b = torch.exp(acc_lse - base), torch.exp(lse - base)
    return acc_out * a[..., None] + out * b[..., None], new


def attend(query: torch.Tensor, layer, scaling: float) -> torch.Tensor:
    """The attention output `[S, q, Hq, dv]` (query's dtype) of `query` `[S, Hq, q, dk]` over packed
    group `layer` (module doc)."""
    pk: PackedKV = layer.packed
    acc, dtype = pk.spec.acc, pk.spec.dtype
    S, Hq, q, dk = query.shape
    G = pk.ring_pos.shape[1]
    r = Hq // G
    qg = query.to(dtype).reshape(S, G, r * q, dk)  # the r query heads of a KV head as its rows
    qp = pk.step_pos.to(pk.ring_pos.device)[:, None, :].expand(S, r, q).reshape(S, 1, r * q, 1)  # query positions
    if q == 1:
        qp = qp[:, :, :1]  # one position per row: the masks broadcast over the query heads
    w = layer.positions.shape[-1]
    widths = pk.step_widths
    rp = pk.ring_pos[:, :, None, :]
    ring_ok = (rp >= 0) & (rp <= qp)  # [S, G, 1 or rq, F]: the full-precision tokens
    out = lse = None
    for c0 in range(0, max(w, 1), CHUNK):
        c1 = min(w, c0 + CHUNK)
        k, v = (x.to(dtype) for x in codes_kv(layer, lambda b: b[:, :, c0:c1], lambda b: b))  # [S, G, c, d]
        pos = layer.pbuf[:, :, c0:c1]
        ok = (layer.stores["slot"][:, :, c0:c1] > 0) & (pos >= 0) & \
             (torch.arange(c0, c1, device=pos.device)[None, None, :] < widths[:, None, None])  # [S, G, c]
        valid = ok[:, :, None, :] & (pos[:, :, None, :] <= qp)
        if c0 == 0:  # the ring with the first chunk: one kernel call while the cache fits a chunk
            k, v = torch.cat([pk.ring_k, k], 2), torch.cat([pk.ring_v, v], 2)
            valid = torch.cat([ring_ok.expand(-1, -1, valid.shape[2], -1), valid], 3)
        out, lse = _merge(out, lse, *_part(qg, k, v, valid, scaling, acc))
    dv = pk.ring_v.shape[-1]
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
    return register_standin(PACKED_NAME, original, _make_fn, "no packed attention", _REGISTERED)


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
