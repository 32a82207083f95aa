"""The state family: what a kept token is stored as.

Shapes: due rows `B`, KV heads `G`, cached tokens `n` (the view's width), kept `k`, head dim `d`,
layers `L`. A state acts at two moments of a compaction of the rows `rows` (the policy calls it):

    before_compaction(cache, rows, keep, view)   after the scorer chose `keep` (`[B, G, k]` shared or
                                                 `[L, B, G, k]`), before the cache gathers it: may
                                                 rewrite the stored tensors of kept tokens
    after_step(cache, next_position, kib_per_token)   after every forward (host values decide)
    after_compaction(cache, rows, next_position, kib_per_token)
                                                 after the gather: may change how the kept tokens are
                                                 stored; returns nothing

and answers a `--trace` run's tracer: `kept_state(cache, rows)`, which kept tokens it stores
otherwise (`merged`, `quantised`; the base class: none), and the meter: `row_kib(cache, row, kib_per_token)`, the KiB row `row` stores now (every layer, head and
store, the bytes of the representation it keeps per token, scales included). The base class is `full`:
full-precision K/V, nothing rewritten, `stored tokens x kib_per_token` bytes (today's meter, bit for
bit). A state needs the per-layer K/V layout of a transformers model (`needs_kv = True`); on a
latent or shared-store layout it is refused before the run.

Built-ins:

* `merge` (value merging, after CaM, Zhang et al., ICML 2024, with D2O's nearest-neighbour match,
  Wan et al., 2024): each evicted token is matched to the kept token of the same (layer, KV head)
  whose key is most similar (cosine), and, when the similarity is at least `threshold`, its value is
  averaged into that token's, weighted by how many original tokens each already represents (a
  per-token count that follows every compaction). Keys are left as they are, so attention to a kept
  token is unchanged while its value carries what the evicted tokens held. A merged token is stored,
  and counted, once.
* `quant` (a quantised tail, after KIVI, Liu et al., ICML 2024): KIVI's rule, once a row has written
  `residual + group` tokens since its last quantisation (and at each compaction), every stored token
  older than the `residual` newest positions is quantised once, asymmetric min-max to `bits` (8 or 4):
  keys per channel over chunks of `group` consecutive tokens (a chunk's scale and zero point per
  channel), values per token over groups of `group` channels; the residual window stays in full
  precision. Dequantisation error: at most half a quantisation step per element, `(max - min) /
  (2 ** bits - 1) / 2` of its group, plus the rounding of the model's dtype (checked by
  `retention check`). The quantised values are kept dequantised in the model's dtype in the cache's
  buffers (the attention reads exactly what a packed int store would give it); the meter counts the
  bytes a packed store holds (in its unit, `kib_per_token` per full-precision token): `bits / 8` bytes per code, a 2-byte scale and zero point per key chunk
  and channel and per value group. So a quantised arm at `--budget-bytes` holds more tokens than
  `full` at the same bytes, and at `--budget` (tokens) it stores fewer bytes.

Plugins subclass `State` (entry-point group `retention.states`, `module:Class`, `file.py:Class`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.runtime.settings import trivial_setting

SCALE_BYTES = 2  # a scale or zero point is stored as a 16-bit float


@dataclass
class State:
    """Base class and the `full` state: kept tokens stay as the model wrote them."""

    name: ClassVar[str] = "full"
    needs_kv: ClassVar[bool] = False  # True: needs the per-layer K/V layout (transformers models)

    def check(self, head_dims: tuple[int, int] | None) -> None:
        """Refuse, before any model work, a model this state cannot store (head_dims: (d_k, d_v) of
        the per-layer K/V layout; None on a latent or shared-store layout)."""
        if self.needs_kv and head_dims is None:
            raise RetentionError(f"state {self.name!r} stores per-layer keys and values; this model's cache has "
                                 "none (use --state full)")

    def reset_slot(self, slot: int, seed: int) -> None:
        """Engine slot `slot` starts a new sequence: drop that slot's state."""

    def before_compaction(self, cache, rows: list[int], keep: torch.Tensor, view) -> None:
        """Rewrite kept tokens' stored tensors before the cache keeps only `keep`."""

    def after_step(self, cache, next_position: list[int], kib_per_token: float) -> None:
        """After every forward (and its compactions): change how tokens are stored between compactions.
        Runs every token: decide from host values; read the device only when something is due."""

    def after_compaction(self, cache, rows: list[int], next_position: list[int], kib_per_token: float) -> None:
        """Change how the kept tokens of `rows` are stored, after the gather (`next_position`: each
        cache row's next query position; `kib_per_token`: the meter's KiB per full-precision token)."""

    def kept_state(self, cache, rows: list[int]) -> dict[str, list[torch.Tensor]]:
        """Which kept tokens this state stores otherwise, right after a compaction of `rows` (read by
        a `--trace` run's tracer, `retention.runtime.trace`): trace field name (`merged`,
        `quantised`) -> per cache group `[B, G, k]` bool over the first `k` entries of each row (the
        kept tokens, in kept order). {}: every kept token as the model wrote it."""
        return {}

    def row_kib(self, cache, row: int, kib_per_token: float) -> float | None:
        """KiB that row `row` stores now (every layer, head and store); None: its stored tokens times
        `kib_per_token` (every token in full precision: the meter multiplies, as it always has)."""
        return None

    def stored_kib(self, cache, row: int, kib_per_token: float) -> float:
        """KiB row `row` stores, recounted from the cache's buffers (the contract kit checks that the
        meter's `row_kib` equals it after every forward)."""
        return cache.lengths[row] * kib_per_token

    @classmethod
    def trivial(cls) -> dict | None:
        """Parameters under which this mechanism must behave exactly as `full` (checked), or None."""
        return None

    def is_trivial(self) -> bool:
        """Whether this instance is at a setting that behaves exactly as the family's default (its
        arm is then the default's cell: `retention.runs.canonical`); by default, `trivial()`'s keys
        at `trivial()`'s values."""
        return trivial_setting(self, self.trivial())

    def tokens_for_kib(self, kib: float, kib_per_token: float, head_dims, layers: int, heads: int, span: int) -> int:
        """The token budget `B` whose measured mean stays within `kib` KiB per sequence under this
        state (`span`: the cadence's tokens above `b`); full precision: `kib / kib_per_token`."""
        return int(kib // kib_per_token)


@dataclass
class Merge(State):
    """Evicted values merged into their nearest kept token (module docstring)."""

    name: ClassVar[str] = "merge"
    needs_kv: ClassVar[bool] = True
    threshold: float = 0.5

    def __post_init__(self):
        if not -1.0 <= self.threshold <= 1.01:
            raise RetentionError(f"merge.threshold is a cosine similarity in [-1, 1] (or 1.01: never merge), "
                                 f"got {self.threshold}")

    @classmethod
    def trivial(cls) -> dict | None:
        return {"threshold": 1.01}  # no cosine reaches it: nothing merges

    def is_trivial(self) -> bool:
        # A cosine never exceeds 1 by more than rounding: any threshold above that merges nothing.
        return self.threshold > 1.0 + 1e-3

    def before_compaction(self, cache, rows, keep, view) -> None:
        dev = keep.device
        ridx = torch.tensor(rows, device=dev)
        for i, layer in enumerate(cache.layers):
            kp = keep if keep.dim() == 3 else keep[i]  # [B, G, k]
            keys, values, valid = view.keys[i].float(), view.values[i], view.valid[i]  # [B, G, n, d], [B, G, n]
            B, G, n, _ = keys.shape
            w = 1.0 + cache.add_extra(i, "merge.count")[:, :, :n].index_select(0, ridx)  # [B, G, n]
            kept = torch.zeros(B, G, n, dtype=torch.bool, device=dev).scatter_(2, kp, True)
            unit = torch.nn.functional.normalize(keys, dim=-1)
            sim = unit @ torch.gather(unit, 2, kp[..., None].expand(-1, -1, -1, unit.shape[-1])).transpose(-1, -2)
            best, j = sim.max(-1)  # [B, G, n]: nearest kept token of each token
            merge = valid & ~kept & (best >= self.threshold)
            wm = w * merge  # [B, G, n] the mass each merged-away token brings
            k = kp.shape[-1]
            add_w = torch.zeros(B, G, k, device=dev).scatter_add_(2, j, wm)
            add_v = torch.zeros(B, G, k, values.shape[-1], device=dev).scatter_add_(
                2, j[..., None].expand(-1, -1, -1, values.shape[-1]), wm[..., None] * values.float())
            w_kept = torch.gather(w, 2, kp)
            v_kept = torch.gather(values.float(), 2, kp[..., None].expand(-1, -1, -1, values.shape[-1]))
            new_v = (w_kept[..., None] * v_kept + add_v) / (w_kept + add_w)[..., None]
            vbuf = layer.stores["v"]
            r_ix = ridx[:, None, None].expand(B, G, k)
            g_ix = torch.arange(G, device=dev)[None, :, None].expand(B, G, k)
            vbuf[r_ix, g_ix, kp] = new_v.to(vbuf.dtype)
            layer.extra["merge.count"][r_ix, g_ix, kp] = w_kept + add_w - 1.0

    def kept_state(self, cache, rows) -> dict[str, list[torch.Tensor]]:
        """`merged`: kept tokens that represent more than themselves (absorbed an evicted token now
        or at an earlier compaction)."""
        return {"merged": _kept_flags(cache, rows, "merge.count")}


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
    _kib: dict = field(default_factory=dict, init=False, repr=False)  # slot -> (KiB at the last event, length then)
    _mark: dict = field(default_factory=dict, init=False, repr=False)  # slot -> positions below it are quantised

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise RetentionError(f"quant.bits must be 8 or 4, got {self.bits}")
        if self.group < 1 or self.residual < 0:
            raise RetentionError(f"quant.group must be >= 1 and quant.residual >= 0, got {self.group}, {self.residual}")
        if self.keys not in ("channel", "token"):
            raise RetentionError(f"quant.keys must be channel or token, got {self.keys!r}")

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

    def _event(self, cache, rows, next_position, kib_per_token) -> None:
        """Quantise every stored token of `rows` older than the residual window, recount their KiB."""
        for r in rows:
            self._mark[cache.slots[r]] = next_position[r] - self.residual
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
        scale = kib_per_token / _full_token_bytes(cache)
        kib = (torch.stack(per_row).sum(0).double() * scale).tolist()  # the one host read of the event
        for r, k in zip(rows, kib, strict=True):
            self._kib[cache.slots[r]] = (k, cache.lengths[r])

    def row_kib(self, cache, row, kib_per_token) -> float:
        got = self._kib.get(cache.slots[row])
        if got is None:  # before the sequence's first compaction: every token in full precision
            return cache.lengths[row] * kib_per_token
        kib, length = got
        return kib + (cache.lengths[row] - length) * kib_per_token  # new tokens arrive in full precision

    def kept_state(self, cache, rows) -> dict[str, list[torch.Tensor]]:
        """`quantised`: kept tokens stored quantised (after the compaction's own quantisation event)."""
        return {"quantised": _kept_flags(cache, rows, "quant.chunk")}

    def reset_slot(self, slot: int, seed: int) -> None:
        self._kib.pop(slot, None)
        self._mark.pop(slot, None)

    def stored_kib(self, cache, row: int, kib_per_token: float) -> float:
        """The recount, token by token on the host (slow; the contract kit's independent figure)."""
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
        return total * kib_per_token / _full_token_bytes(cache)

    def error_bound(self, x: torch.Tensor, group_lo: torch.Tensor, group_hi: torch.Tensor) -> torch.Tensor:
        """The largest dequantisation error allowed for elements `x` of groups spanning
        [`group_lo`, `group_hi`]: half a quantisation step."""
        return (group_hi - group_lo) / (2 ** self.bits - 1) / 2


def _kept_flags(cache, rows: list[int], name: str) -> list[torch.Tensor]:
    """Per cache group `[B, G, k]` bool: per-token state `name` is non-zero on the kept tokens of
    `rows` (all False where the state was never registered: nothing to flag yet)."""
    k = cache.lengths[rows[0]]
    out = []
    for layer in cache.layers:
        ridx = torch.tensor(rows, device=layer.pbuf.device)
        flag = layer.extra.get(name)
        out.append(torch.zeros(len(rows), layer.pbuf.shape[1], k, dtype=torch.bool, device=layer.pbuf.device)
                   if flag is None else flag[:, :, :k].index_select(0, ridx) != 0)
    return out


def _full_token_bytes(cache) -> int:
    """Bytes one full-precision token costs in every layer and KV head of the cache (K and V)."""
    return sum(layer.token_bytes() for layer in cache.layers)


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
