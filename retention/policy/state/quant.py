"""The `quant` state: a KIVI-style quantised tail (`retention.policy.state.base`).

Two stores, one rule (`store`):

* `packed` (new runs): the cache really holds codes and float16 grids (`retention.runtime.packed_kv`)
  and its attention dequantises them a chunk at a time (`retention.runtime.packed_attention`); the
  meter's KiB are the bytes of those tensors. A prefill's plain cache is turned packed at its first
  hook (`after_step` or `after_compaction`), so every batch cache built from it is packed.
* `simulated` (every configuration written before the packed store: an arm configuration without
  `store`, recorded without it): the dequantised values overwrite the model-dtype buffers in place,
  and the meter counts what a packed store would hold.

Which one an arm runs: its configuration's `store`, absent meaning simulated (the `sampler`
precedent); the entry points that start new runs (`retention run`/`check`, the API, `preregister`)
name `packed` where the user names no store (`retention.policy.registry.new_run_entry`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.state.base import SCALE_BYTES, State, full_token_bytes, kept_flags
from retention.runtime.packed_attention import packed_attention
from retention.runtime.packed_kv import PackSpec, quantise, row_bytes, to_packed

STORES = ("packed", "simulated")


@dataclass
class Quant(State):
    """A KIVI-style quantised tail with a full-precision residual window (module docstring)."""

    name: ClassVar[str] = "quant"
    needs_kv: ClassVar[bool] = True
    bits: int = 8
    group: int = 16  # divides the head dims of every model here (16 tiny, 64 Qwen2.5-0.5B, 128 the 7B/8B)
    residual: int = 32
    # "channel": KIVI's keys, per channel over chunks of `group` tokens (a chunk's scales stay while one
    # of its tokens does, so evictions make them dearer); "token": keys like values, per token over
    # groups of `group` channels (a fixed cost per token, so a byte budget is held exactly).
    keys: str = "channel"
    # "packed": codes in the cache, attention dequantises on the fly; "simulated": dequantised values in
    # the model's dtype, bytes metered as if packed (module docstring). Recorded only when packed.
    store: str = "packed"
    _kib: dict = field(default_factory=dict, init=False, repr=False)  # slot -> (KiB at the last event, length then)
    _mark: dict = field(default_factory=dict, init=False, repr=False)  # slot -> positions below it are quantised

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise RetentionError(f"quant.bits must be 8 or 4, got {self.bits}")
        if self.group < 1 or self.residual < 0:
            raise RetentionError(f"quant.group must be >= 1 and quant.residual >= 0, got {self.group}, {self.residual}")
        if self.keys not in ("channel", "token"):
            raise RetentionError(f"quant.keys must be channel or token, got {self.keys!r}")
        if self.store not in STORES:
            raise RetentionError(f"quant.store must be packed or simulated, got {self.store!r}")

    @classmethod
    def written_params(cls, params: dict) -> dict:
        """A configuration's parameters as it ran: one without `store` (every configuration written
        before it) ran the simulated store, as a configuration without `sampler` was drawn by
        `multinomial`. New runs name `store` (`new_run_params`)."""
        return params if "store" in params else {**params, "store": "simulated"}

    @classmethod
    def new_run_params(cls) -> dict:
        """What a run started now gets where its entry sets no `store` (`registry.new_run_entry`)."""
        return {"store": "packed"}

    @classmethod
    def unrecorded(cls) -> dict:
        """Parameters left out of the recorded configuration at these values (absent is how a
        configuration says simulated: its hash is the one it had before `store`)."""
        return {"store": "simulated"}

    def attach(self, model):
        """The packed store's attention for the run's forwards (`packed_attention`)."""
        return packed_attention(model) if self.store == "packed" else contextlib.nullcontext()

    def _spec(self, cache) -> PackSpec:
        kb = cache.layers[0].stores["k"]
        return PackSpec(self.bits, self.group, self.keys, self.residual + self.group, kb.dtype)

    def check(self, head_dims) -> None:
        super().check(head_dims)
        if head_dims[1] % self.group or (self.keys == "token" and head_dims[0] % self.group):
            raise RetentionError(f"quant.group {self.group} does not divide the head dim {head_dims[1]}; "
                                 f"use a divisor (e.g. --param quant.group={math.gcd(self.group, head_dims[1])})")

    def code_bytes(self, dk: int, dv: int) -> float:
        """Bytes of one quantised token of one (layer, head): codes plus its own groups' scales (the
        values', and the keys' with `keys="token"`; per-channel key chunks are counted apart)."""
        groups = dv // self.group + (dk // self.group if self.keys == "token" else 0)
        return (dk + dv) * self.bits / 8 + groups * 2 * SCALE_BYTES

    def chunk_bytes(self, dk: int) -> int:
        """Bytes of one per-channel key chunk's scales and zero points (0 with `keys="token"`)."""
        return dk * 2 * SCALE_BYTES if self.keys == "channel" else 0

    def tokens_for_kib(self, kib, kib_per_token, head_dims, layers, heads, span) -> int:
        """Fewer than `residual + group` tokens are in full precision at any step (the residual window
        plus the tokens written since the last quantisation); every other token costs its codes, its
        value scales and its share of a key chunk's scales, `1 / group` of them while chunks are
        whole (`keys="token"`: its own key scales, exactly). So `B = F + (kib - F x full) /
        quantised` with `F = residual + group`; fewer KiB than
        `F` full tokens hold only `kib / full` tokens. Evictions thin chunks out (a chunk's scales stay
        while one of its tokens does), so the measured bytes can exceed this estimate: the meter
        measures them and flags a record over `--budget-bytes`."""
        dk, dv = head_dims
        quantised = layers * heads * (self.code_bytes(dk, dv) + self.chunk_bytes(dk) / self.group) / 1024
        full = self.residual + self.group
        if kib <= full * kib_per_token:
            return int(kib // kib_per_token)
        return full + int((kib - full * kib_per_token) // quantised)

    def after_compaction(self, cache, rows, next_position, kib_per_token) -> None:
        self._event(cache, rows, next_position, kib_per_token)  # kept sets changed: recount (and quantise)

    def after_step(self, cache, next_position, kib_per_token) -> None:
        """KIVI's rule: once a row holds `residual + group` tokens written since its last quantisation,
        quantise all but the `residual` newest (host ints decide: no device read unless it is due)."""
        due = [r for r in range(cache.rows)
               if next_position[r] - self._mark.get(cache.slots[r], 0) >= self.residual + self.group]
        if due:
            self._event(cache, due, next_position, kib_per_token)
        elif self.store == "packed" and cache.layers[0].packed is None:
            self._event(cache, [], next_position, kib_per_token)  # a prefill's plain cache: packed now

    def _event(self, cache, rows, next_position, kib_per_token) -> None:
        """Quantise every stored token of `rows` older than the residual window, recount their KiB."""
        for r in rows:
            self._mark[cache.slots[r]] = next_position[r] - self.residual
        if self.store == "packed":
            self._event_packed(cache, rows, kib_per_token)
            return
        dev = cache.layers[0].pbuf.device
        ridx = torch.tensor(rows, device=dev)
        lens = torch.tensor([cache.lengths[r] for r in rows], device=dev)
        cutoff = torch.tensor([next_position[r] - self.residual for r in rows], device=dev)
        per_row = []
        for i, layer in enumerate(cache.layers):
            n = int(lens.max())
            flag = cache.add_extra(i, "quant.chunk", dtype=torch.long)  # 0: full precision, else chunk id
            chunk = flag[:, :, :n].index_select(0, ridx)  # [B, G, n]
            pos = layer.pbuf[:, :, :n].index_select(0, ridx)
            valid = torch.arange(n, device=dev)[None, None, :] < lens[:, None, None]
            new = valid & (chunk == 0) & (pos < cutoff[:, None, None])  # [B, G, n] to quantise now
            if bool(new.any()):
                rank = new.long().cumsum(-1) - 1
                cidx = torch.where(new, rank // self.group, 0)  # [B, G, n] chunk within this event
                base = chunk.amax(-1, keepdim=True)  # ids keep growing: a new chunk never joins an old one
                chunk = torch.where(new, base + 1 + cidx, chunk)
                flag[ridx, :, :n] = chunk
                for name, per_channel in (("k", self.keys == "channel"), ("v", False)):
                    buf = layer.stores[name]
                    x = buf[:, :, :n].index_select(0, ridx)
                    q = _quantise_keys(x, new, cidx, self.bits) if per_channel else \
                        _quantise_values(x, self.group, self.bits)
                    buf[ridx, :, :n] = torch.where(new[..., None], q.to(buf.dtype), x)
            dk, dv = layer.stores["k"].shape[-1], layer.stores["v"].shape[-1]
            quantised = valid & (chunk > 0)
            nq = quantised.sum((1, 2))  # [B]
            # Alive key chunks: distinct chunk ids among the stored quantised tokens of each (row, head).
            s = torch.sort(torch.where(quantised, chunk, 0), -1).values
            alive = ((s[..., 1:] != s[..., :-1]) & (s[..., 1:] > 0)).sum((1, 2)) + (s[..., 0] > 0).sum(1)
            nf = lens * layer.stores["k"].shape[1] - nq
            e = layer.stores["k"].element_size()
            per_row.append(nf * (dk + dv) * e + nq * self.code_bytes(dk, dv) + alive * self.chunk_bytes(dk))
        # Bytes in units of `kib_per_token` per full-precision token (the meter's unit, whatever the dtype).
        scale = kib_per_token / full_token_bytes(cache)
        kib = (torch.stack(per_row).sum(0).double() * scale).tolist()  # the one host read of the event
        for r, k in zip(rows, kib, strict=True):
            self._kib[cache.slots[r]] = (k, cache.lengths[r])

    def _event_packed(self, cache, rows, kib_per_token) -> None:
        """The packed store's event: a plain cache turned packed (rows not due keep their marks), the
        due rows quantised, their KiB recounted from the tensors (`packed_kv.row_bytes`)."""
        dev = cache.layers[0].pbuf.device
        if cache.layers[0].packed is None:
            cut = torch.tensor([self._mark.get(s, 0) for s in cache.slots], device=dev)
            lens = torch.tensor(cache.widths, device=dev)
            spec = self._spec(cache)
            for layer in cache.layers:
                to_packed(layer, spec, lens, cut)
                layer.set_width(layer.positions.shape[-1])
        elif rows:
            ridx = torch.tensor(rows, device=dev)
            lens = torch.tensor([cache.widths[r] for r in rows], device=dev)
            cut = torch.tensor([self._mark[cache.slots[r]] for r in rows], device=dev)
            for layer in cache.layers:
                quantise(layer, ridx, lens, cut)
        if not rows:
            return
        ridx = torch.tensor(rows, device=dev)
        lens = torch.tensor([cache.widths[r] for r in rows], device=dev)
        scale = kib_per_token / full_token_bytes(cache)
        got = sum(row_bytes(layer, ridx, lens) for layer in cache.layers)
        for r, b in zip(rows, (got.double() * scale).tolist(), strict=True):  # the one host read of the event
            self._kib[cache.slots[r]] = (b, cache.lengths[r])

    def row_kib(self, cache, row, kib_per_token) -> float:
        got = self._kib.get(cache.slots[row])
        if got is None:  # before the sequence's first compaction: every token in full precision
            return cache.lengths[row] * kib_per_token
        kib, length = got
        return kib + (cache.lengths[row] - length) * kib_per_token  # new tokens arrive in full precision

    def kept_state(self, cache, rows) -> dict[str, list[torch.Tensor]]:
        """`quantised`: kept tokens stored quantised (after the compaction's own quantisation event)."""
        if cache.layers[0].packed is not None:
            k = cache.lengths[rows[0]]
            return {"quantised": [ly.stores["slot"][:, :, :k].index_select(0, torch.tensor(rows, device=ly.pbuf.device)) != 0
                                  for ly in cache.layers]}
        return {"quantised": kept_flags(cache, rows, "quant.chunk")}

    def reset_slot(self, slot: int, seed: int) -> None:
        self._kib.pop(slot, None)
        self._mark.pop(slot, None)

    def stored_kib(self, cache, row: int, kib_per_token: float) -> float:
        """The recount, token by token on the host (slow; the contract kit's independent figure); a
        packed cache: the bytes its tensors hold for the row (`packed_kv.row_bytes`)."""
        if cache.layers[0].packed is not None:
            dev = cache.layers[0].pbuf.device
            ridx, lens = torch.tensor([row], device=dev), torch.tensor([cache.widths[row]], device=dev)
            got = sum(int(row_bytes(layer, ridx, lens)[0]) for layer in cache.layers)
            return got * kib_per_token / full_token_bytes(cache)
        total = 0.0
        n = cache.lengths[row]
        for layer in cache.layers:
            dk, dv, e = layer.stores["k"].shape[-1], layer.stores["v"].shape[-1], layer.stores["k"].element_size()
            chunks = layer.extra.get("quant.chunk")
            ids = chunks[row, :, :n].tolist() if chunks is not None else [[0] * n] * layer.stores["k"].shape[1]
            for head in ids:
                quantised = [c for c in head if c > 0]
                total += (n - len(quantised)) * (dk + dv) * e + len(quantised) * self.code_bytes(dk, dv)
                total += len(set(quantised)) * self.chunk_bytes(dk)
        return total * kib_per_token / full_token_bytes(cache)

    def error_bound(self, x: torch.Tensor, group_lo: torch.Tensor, group_hi: torch.Tensor) -> torch.Tensor:
        """The largest dequantisation error allowed for elements `x` of groups spanning
        [`group_lo`, `group_hi`]: half a quantisation step."""
        return (group_hi - group_lo) / (2 ** self.bits - 1) / 2


def _minmax_quantise(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min-max quantise-dequantise of `x` with per-element `lo`/`hi` (broadcast), float32."""
    levels = 2 ** bits - 1
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    code = torch.clamp(torch.round((x - lo) / safe), 0, levels)
    return torch.where(scale > 0, code * scale + lo, lo)


def _quantise_keys(x: torch.Tensor, new: torch.Tensor, cidx: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys `[B, G, n, d]`: per channel over each chunk `cidx` `[B, G, n]` of the tokens `new`."""
    xf = x.float()
    B, G, n, d = xf.shape
    chunks = int(cidx.max()) + 1
    idx = cidx[..., None].expand(-1, -1, -1, d)
    big = torch.finfo(torch.float32).max
    lo = torch.full((B, G, chunks, d), big, device=x.device).scatter_reduce(
        2, idx, torch.where(new[..., None], xf, big), "amin")
    hi = torch.full((B, G, chunks, d), -big, device=x.device).scatter_reduce(
        2, idx, torch.where(new[..., None], xf, -big), "amax")
    return _minmax_quantise(xf, torch.gather(lo, 2, idx), torch.gather(hi, 2, idx), bits)


def _quantise_values(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Values `[B, G, n, d]`: per token over groups of `group` channels."""
    xf = x.float()
    g = xf.view(*xf.shape[:-1], xf.shape[-1] // group, group)
    q = _minmax_quantise(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), bits)
    return q.view_as(xf)
