"""A packed quantised K/V store for one cache group (the `quant` state's `store="packed"`).

Shapes: rows `S` (due rows `B`), KV heads `G`, capacity `cap`, ring entries `F`, key/value head dims
`dk`/`dv`, channel groups `dv / group` (`dk / group`), key chunks `C`, view width `w`.

Layout (one `RetentionLayer` whose `packed` is a `PackedKV`):

* token-axis stores (they follow every compaction, row move, refill and growth like any store):
  `qk` `[S, G, cap, dk * bits / 8]` and `qv` `[S, G, cap, dv * bits / 8]` uint8 codes (int8: one
  code a byte; int4: two, the even channel in the low nibble); `sv` `[S, G, cap, dv / group, 2]`
  float16 value scale and zero point per token and channel group; with `keys="token"` also `sk`
  `[S, G, cap, dk / group, 2]`; `slot` `[S, G, cap]` int32: 0 while the token is in full precision,
  else 1 + its key chunk's entry in `table` (1 with `keys="token"`).
* per-row side buffers (`PackedKV`, moved with rows, never compacted by position): the ring
  `ring_k` `[S, G, F, dk]`, `ring_v` `[S, G, F, dv]` in the model's dtype holding the tokens still in
  full precision at entry `position mod F` (`F = residual + group`: the most the quant rule lets stand
  unquantised, `retention.policy.state.quant`), `ring_pos` `[S, G, F]` int64 (-1: free); with
  `keys="channel"` the key chunks' scale and zero point `table` `[S, G, C, dk, 2]` float16, entry
  `slot - 1`, compacted with the tokens so that a row's live chunks are its first entries.

Quantised tokens are always a row's oldest (quantisation is by position below a cutoff and a
compaction keeps order), so along the token axis a head's slots are non-decreasing and a chunk's
tokens are contiguous: compaction renumbers them by rank (`compacted`).

The grid: min-max asymmetric, the zero point `lo16` rounded down and the scale `s16` rounded up to
float16 (`grid`), so `[lo, hi]` lies inside `lo16 + [0, levels] x s16` and every dequantisation
error is at most `s16 / 2`, half a step of the stored grid (the simulated store's bound, with its
float32 `lo` and step rounded outward to float16: `s16 <= (hi - lo + |lo| 2^-9) / levels x (1 + 2^-8)`,
in float16's normal range; below it, within its subnormal spacing, 6e-8; keys and values beyond its
largest value, 65504, are not representable).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16  # a scale or zero point: 2 bytes (the meter's `SCALE_BYTES`)
CHUNK = 256  # tokens dequantised at a time by the attention (`retention.runtime.packed_attention`)


@dataclass(frozen=True)
class PackSpec:
    """What a packed store holds: `bits` (8 or 4), channel `group`, `keys` ("channel": per channel
    over chunks of `group` tokens; "token": per token over channel groups), ring entries `ring`
    (`residual + group`) and the model's `dtype` (the full-precision tokens)."""

    bits: int
    group: int
    keys: str
    ring: int
    dtype: torch.dtype

    @property
    def levels(self) -> int:
        return 2 ** self.bits - 1

    def width(self, d: int) -> int:
        """Bytes of one token's codes over `d` channels."""
        return d * self.bits // 8

    @property
    def acc(self) -> torch.dtype:
        """The dtype the attention accumulates in (float64 on a float64 model, else float32)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[..., d]` (each < 2^bits) -> `[..., d * bits / 8]` uint8."""
    if bits == 8:
        return codes
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """`[..., d * bits / 8]` uint8 -> the codes `[..., d]` uint8 (inverse of `pack`)."""
    if bits == 8:
        return packed
    return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)


def grid(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored grid `[..., 2]` float16 (scale, zero point) of groups spanning `[lo, hi]` (float32):
    the zero point rounded down, the scale up (module doc), so no code clamps."""
    lo16 = (lo - lo.abs() * 2.0 ** -10).to(SCALE_DTYPE)  # round-to-nearest of a value below lo: <= lo
    s16 = ((hi - lo16.float()) / (2 ** bits - 1) * (1 + 2.0 ** -9)).to(SCALE_DTYPE)
    return torch.stack((s16, lo16), -1)


def encode(x: torch.Tensor, g: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (uint8, same shape as `x`) of `x` (float) on grids `g` `[..., 2]` broadcast to it."""
    s, lo = g[..., 0].float(), g[..., 1].float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    code = torch.clamp(torch.round((x.float() - lo) / safe), 0, 2 ** bits - 1)
    return torch.where(s > 0, code, 0).to(torch.uint8)


def decode(codes: torch.Tensor, g: torch.Tensor, spec: PackSpec) -> torch.Tensor:
    """Dequantised values in the model's dtype: `code x s16 + lo16` in float32 (the simulated store's
    arithmetic, `retention.policy.state.quant`), then rounded to the model's dtype."""
    return (codes.float() * g[..., 0].float() + g[..., 1].float()).to(spec.dtype)


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


def token_grid(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Per token, over groups of `group` channels: `[..., n, d]` -> grids `[..., n, d / group, 2]`."""
    g = _grouped(x.float(), group)
    return grid(g.amin(-1), g.amax(-1), bits)


def chunk_grid(x: torch.Tensor, new: torch.Tensor, cidx: torch.Tensor, chunks: int, bits: int) -> torch.Tensor:
    """Per channel over each chunk `cidx` `[B, G, n]` of the tokens `new`: keys `[B, G, n, d]` ->
    grids `[B, G, chunks, d, 2]` (a chunk no token falls in: the empty range, never read)."""
    xf = x.float()
    B, G, n, d = xf.shape
    idx = cidx[..., None].expand(-1, -1, -1, d)
    big = torch.finfo(torch.float32).max
    lo = torch.full((B, G, chunks, d), big, device=x.device).scatter_reduce(2, idx, torch.where(new[..., None], xf, big), "amin")
    hi = torch.full((B, G, chunks, d), -big, device=x.device).scatter_reduce(2, idx, torch.where(new[..., None], xf, -big), "amax")
    empty = lo > hi
    return grid(torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi), bits)


@dataclass
class PackedKV:
    """The per-row side buffers of one packed group (module doc) and, during a forward, what its
    attention reads besides them: `step_widths` `[S]` each row's width after the write and
    `step_pos` `[S, q]` the positions of the forward's queries."""

    spec: PackSpec
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    ring_pos: torch.Tensor
    table: torch.Tensor | None
    step_widths: torch.Tensor | None = None
    step_pos: torch.Tensor | None = None

    def _side(self) -> dict[str, torch.Tensor]:
        side = {"ring_k": self.ring_k, "ring_v": self.ring_v, "ring_pos": self.ring_pos}
        return side if self.table is None else {**side, "table": self.table}

    def rows(self, ridx: torch.Tensor) -> PackedKV:
        """A copy holding rows `ridx`, in that order."""
        return dataclasses.replace(self, **{k: v.index_select(0, ridx) for k, v in self._side().items()},
                                   step_widths=None, step_pos=None)

    def empty(self, rows: int) -> PackedKV:
        """`rows` empty rows of this geometry (ring entries free, one key chunk entry per row)."""
        def fresh(name, b):
            shape = (rows, *b.shape[1:]) if name != "table" else (rows, b.shape[1], 1, *b.shape[3:])
            return torch.full(shape, -1, dtype=b.dtype, device=b.device) if name == "ring_pos" else \
                torch.zeros(shape, dtype=b.dtype, device=b.device)
        return dataclasses.replace(self, **{k: fresh(k, v) for k, v in self._side().items()},
                                   step_widths=None, step_pos=None)

    def load_row(self, row: int, src: PackedKV, src_row: int) -> None:
        """Replace `row` with row `src_row` of `src` (its ring and its key chunks)."""
        self.ring_k[row], self.ring_v[row], self.ring_pos[row] = src.ring_k[src_row], src.ring_v[src_row], src.ring_pos[src_row]
        if self.table is not None:
            n = src.table.shape[2]
            self.grow_table(n)
            self.table[row, :, :n] = src.table[src_row]

    def grow_table(self, chunks: int) -> None:
        """Make room for `chunks` key chunk entries per (row, head) (doubling)."""
        C = self.table.shape[2]
        if chunks <= C:
            return
        new = self.table.new_zeros(*self.table.shape[:2], max(2 * C, chunks), *self.table.shape[3:])
        new[:, :, :C] = self.table
        self.table = new

    def allocated_bytes(self) -> int:
        return sum(b.nbytes for b in self._side().values() if b.dtype != torch.long)

    def write(self, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A forward's new tokens into the ring: `pos` `[S, q]`, `keys`/`values` `[S, G, q, d]`."""
        G = self.ring_pos.shape[1]
        p = pos.to(self.ring_pos.device)[:, None, :].expand(-1, G, -1)  # [S, G, q]
        e = torch.remainder(p, self.spec.ring)
        self.ring_k.scatter_(2, e[..., None].expand_as(keys), keys.to(self.ring_k.dtype))
        self.ring_v.scatter_(2, e[..., None].expand_as(values), values.to(self.ring_v.dtype))
        self.ring_pos.scatter_(2, e, p)


def new_packed(spec: PackSpec, rows: int, heads: int, cap: int, dk: int, dv: int, device) -> tuple[PackedKV, dict]:
    """An empty packed group: its side buffers and its token-axis stores (module doc)."""
    z = lambda *s, dtype: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
    stores = {"qk": z(rows, heads, cap, spec.width(dk), dtype=torch.uint8),
              "qv": z(rows, heads, cap, spec.width(dv), dtype=torch.uint8),
              "sv": z(rows, heads, cap, dv // spec.group, 2, dtype=SCALE_DTYPE),
              "slot": z(rows, heads, cap, dtype=torch.int32)}
    if spec.keys == "token":
        stores["sk"] = z(rows, heads, cap, dk // spec.group, 2, dtype=SCALE_DTYPE)
    table = None if spec.keys == "token" else z(rows, heads, max(1, cap // spec.group), dk, 2, dtype=SCALE_DTYPE)
    side = PackedKV(spec, z(rows, heads, spec.ring, dk, dtype=spec.dtype), z(rows, heads, spec.ring, dv, dtype=spec.dtype),
                    torch.full((rows, heads, spec.ring), -1, dtype=torch.long, device=device), table)
    return side, stores


def dequantise(layer, ridx: torch.Tensor | None, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[B, G, c1 - c0, d]` in the model's dtype of entries `c0:c1` of rows `ridx`
    (None: all): codes where a token is quantised, the ring's entry where it is in full precision
    (padding and holes: whatever the ring holds at their index; masked by every reader)."""
    def take(b):
        b = b[:, :, c0:c1]
        return b if ridx is None else b.index_select(0, ridx)

    return _dequantise(layer, take, (lambda b: b) if ridx is None else (lambda b: b.index_select(0, ridx)))


def dequantise_at(layer, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[S, G, q, d]` of the entries `idx` `[S, G, q]` of every row (`dequantise`)."""
    def take(b):
        return torch.gather(b, 2, idx.reshape(*idx.shape, *([1] * (b.dim() - 3))).expand(*idx.shape, *b.shape[3:]))

    return _dequantise(layer, take, lambda b: b)


def _dequantise(layer, take, rows) -> tuple[torch.Tensor, torch.Tensor]:
    pk: PackedKV = layer.packed
    k, v = (x.to(pk.spec.dtype) for x in codes_kv(layer, take, rows))
    pos, slot = take(layer.pbuf), take(layer.stores["slot"])
    e = torch.remainder(pos, pk.spec.ring)
    rk, rv = rows(pk.ring_k), rows(pk.ring_v)
    rk = torch.gather(rk, 2, e[..., None].expand(*e.shape, rk.shape[-1]))
    rv = torch.gather(rv, 2, e[..., None].expand(*e.shape, rv.shape[-1]))
    quant = (slot > 0)[..., None]
    return torch.where(quant, k, rk), torch.where(quant, v, rv)


def codes_kv(layer, take, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """What the codes of the entries `take` selects (a function of a token-axis store, `[B, G, c, ...]`)
    dequantise to, keys and values `[B, G, c, d]` float32, unrounded (`decode`'s arithmetic before its
    rounding to the model's dtype, per group by broadcasting: no per-channel copy of a grid); `rows`
    selects the side buffers' rows.
    Entries in full precision (`slot == 0`) give whatever their stale codes say: callers mask them."""
    pk: PackedKV = layer.packed
    spec, st = pk.spec, layer.stores
    ck = unpack(take(st["qk"]), spec.bits).float()  # [B, G, c, dk]
    if spec.keys == "channel":
        slot = take(st["slot"])
        tab = rows(pk.table)  # [B, G, C, dk, 2]
        B, G, C = tab.shape[:3]
        # One row lookup per token (index_select over the flattened table: far cheaper than a gather).
        flat = torch.arange(B * G, device=tab.device).view(B, G, 1) * C + (slot.long() - 1).clamp(min=0)
        kg = tab.reshape(B * G * C, -1).index_select(0, flat.reshape(-1)).view(*slot.shape, -1, 2)
        # In place on the fresh float32 codes, the float16 grid promoted exactly: no float32 copy of it.
        k = ck.mul_(kg[..., 0]).add_(kg[..., 1])
    else:
        k = _grouped_decode(ck, take(st["sk"]), spec.group)
    v = _grouped_decode(unpack(take(st["qv"]), spec.bits).float(), take(st["sv"]), spec.group)
    return k, v


def _grouped_decode(codes: torch.Tensor, g: torch.Tensor, group: int) -> torch.Tensor:
    """float32 codes `[..., d]` (a fresh tensor, overwritten) on per-group grids `[..., d / group, 2]`:
    `code x s + lo` (float32)."""
    x = codes.reshape(*codes.shape[:-1], -1, group)
    return x.mul_(g[..., 0:1]).add_(g[..., 1:2]).reshape(codes.shape)


def _grouped_grid(g: torch.Tensor, group: int) -> torch.Tensor:
    """Per-group grids `[..., d / group, 2]` -> per channel `[..., d, 2]`."""
    return g.repeat_interleave(group, dim=-2)


def quantise(layer, ridx: torch.Tensor, lens: torch.Tensor, cutoff: torch.Tensor,
             source: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Quantise every stored full-precision token of rows `ridx` (`[B]`, stored widths `lens`)
    whose position is below `cutoff` (`[B]`): codes and grids into the token-axis stores, new key
    chunks of `group` consecutive such tokens per (row, head) after the row's live ones, their ring
    entries freed. `source`: the rows' plain keys/values `[B, G, n, d]` (a conversion), else the ring."""
    pk: PackedKV = layer.packed
    spec, st = pk.spec, layer.stores
    n = int(lens.max())
    if n == 0:
        return
    slot = st["slot"][:, :, :n].index_select(0, ridx)
    pos = layer.pbuf[:, :, :n].index_select(0, ridx)
    valid = torch.arange(n, device=pos.device)[None, None, :] < lens[:, None, None]
    new = valid & (pos >= 0) & (slot == 0) & (pos < cutoff[:, None, None])  # [B, G, n]
    if source is None:
        e = torch.remainder(pos, spec.ring)
        rk, rv = pk.ring_k.index_select(0, ridx), pk.ring_v.index_select(0, ridx)
        xk = torch.gather(rk, 2, e[..., None].expand(*e.shape, rk.shape[-1]))
        xv = torch.gather(rv, 2, e[..., None].expand(*e.shape, rv.shape[-1]))
    else:
        xk, xv = source
    gv = token_grid(xv, spec.group, spec.bits)  # [B, G, n, dv / group, 2]
    cv = pack(encode(xv, _grouped_grid(gv, spec.group), spec.bits), spec.bits)
    upd = {"qv": cv, "sv": gv}
    if spec.keys == "token":
        gk = token_grid(xk, spec.group, spec.bits)
        upd.update(qk=pack(encode(xk, _grouped_grid(gk, spec.group), spec.bits), spec.bits), sk=gk,
                   slot=torch.ones_like(slot))
    else:
        rank = new.long().cumsum(-1) - 1
        cidx = torch.where(new, rank // spec.group, 0)  # [B, G, n]: chunk within this event
        # [B, G, 1]: live chunks (compacted: the first ones; entries past a row's width are stale)
        live = torch.where(valid, slot, 0).amax(-1, keepdim=True).long()
        chunks = int(cidx.amax()) + 1
        gk = chunk_grid(xk, new, cidx, chunks, spec.bits)  # [B, G, chunks, dk, 2]
        per_tok = torch.gather(gk, 2, cidx[..., None, None].expand(*cidx.shape, *gk.shape[3:]))
        upd.update(qk=pack(encode(xk, per_tok, spec.bits), spec.bits), slot=(live + 1 + cidx).int())
        pk.grow_table(int(live.amax()) + chunks)
        target = (live + torch.arange(chunks, device=live.device)).clamp(max=pk.table.shape[2] - 1)  # [B, G, chunks]
        sub = pk.table.index_select(0, ridx)
        last = torch.where(new, cidx, -1).amax(-1, keepdim=True)  # [B, G, 1]: the head's last new chunk
        made = torch.arange(chunks, device=cidx.device) <= last  # [B, G, chunks]
        old = torch.gather(sub, 2, target[..., None, None].expand_as(gk))
        sub.scatter_(2, target[..., None, None].expand_as(gk), torch.where(made[..., None, None], gk, old))
        pk.table[ridx] = sub
    for name, x in upd.items():
        b = st[name]
        cur = b[:, :, :n].index_select(0, ridx)
        m = new.reshape(*new.shape, *([1] * (cur.dim() - 3)))
        b[ridx, :, :n] = torch.where(m, x.to(b.dtype), cur)
    rp = pk.ring_pos.index_select(0, ridx)
    pk.ring_pos[ridx] = rp.masked_fill((rp >= 0) & (rp < cutoff[:, None, None]), -1)


def compacted(layer, ridx: torch.Tensor | None, k: int) -> None:
    """After the cache gathered the kept tokens of rows `ridx` (None: all) to their first `k`
    entries: the ring keeps only their full-precision tokens, and the live key chunks move to the
    front of the table in token order (each token's slot renumbered by its chunk's rank)."""
    pk: PackedKV = layer.packed
    st = layer.stores

    def take(b):
        return b[:, :, :k] if ridx is None else b[:, :, :k].index_select(0, ridx)

    pos = take(layer.pbuf)
    slot = torch.where(pos >= 0, take(st["slot"]).long(), 0)  # a hole (position -1) holds nothing
    full = (slot == 0) & (pos >= 0)
    B, G, F = slot.shape[0], slot.shape[1], pk.spec.ring
    e = torch.where(full, torch.remainder(pos, F), F)  # F: a scratch entry dropped below
    rp = torch.full((B, G, F + 1), -1, dtype=torch.long, device=pos.device).scatter_(2, e, torch.where(full, pos, -1))
    rows = ridx if ridx is not None else torch.arange(pk.ring_pos.shape[0], device=pos.device)
    pk.ring_pos[rows] = rp[..., :F]
    if pk.table is None or k == 0:
        return
    prev = torch.cat([slot.new_zeros(B, G, 1), slot[..., :-1]], -1)
    first = (slot > 0) & (slot != prev)  # a chunk's first kept token (slots are non-decreasing)
    rank = first.long().cumsum(-1)  # [B, G, k]: 1-based new slot
    new_slot = torch.where(slot > 0, rank, 0)
    tab = pk.table.index_select(0, rows)
    src = torch.gather(tab, 2, (slot - 1).clamp(min=0)[..., None, None].expand(B, G, k, *tab.shape[3:]))
    dst = torch.where(first, rank - 1, tab.shape[2])  # non-first tokens write into a scratch entry
    out = torch.cat([torch.zeros_like(tab), tab[:, :, :1]], 2).scatter_(
        2, dst[..., None, None].expand_as(src), src)[:, :, :tab.shape[2]]
    pk.table[rows] = out
    if ridx is None:
        st["slot"][:, :, :k] = new_slot.int()
    else:
        st["slot"][ridx, :, :k] = new_slot.int()


def row_bytes(layer, ridx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """`[B]` bytes rows `ridx` hold, from the tensors: each quantised token's codes and grids (an
    entry's `nbytes` of `qk`, `qv`, `sv`, `sk`), each full-precision ring entry (`ring_k`, `ring_v`)
    and each live key chunk's grid (`table`). The slot indices and positions are bookkeeping, as
    the positions of every state are: not counted."""
    pk: PackedKV = layer.packed
    st = layer.stores
    n = max(1, int(lens.max()))
    slot = st["slot"][:, :, :n].index_select(0, ridx)
    pos = layer.pbuf[:, :, :n].index_select(0, ridx)
    valid = (torch.arange(n, device=pos.device)[None, None, :] < lens[:, None, None]) & (pos >= 0)
    quant = (valid & (slot > 0)).sum((1, 2))
    full = (pk.ring_pos.index_select(0, ridx) >= 0).sum((1, 2))
    per_q = sum(st[name][0, 0, 0].nbytes for name in ("qk", "qv", "sv", "sk") if name in st)
    per_f = pk.ring_k[0, 0, 0].nbytes + pk.ring_v[0, 0, 0].nbytes
    out = quant * per_q + full * per_f
    if pk.table is not None:
        live = torch.where(valid, slot, 0).amax(-1).sum(-1)  # [B]: live chunks are the first entries
        out = out + live * pk.table[0, 0, 0].nbytes
    return out


def to_packed(layer, spec: PackSpec, lens: torch.Tensor, cutoff: torch.Tensor) -> None:
    """Turn a plain K/V group (`stores` `k`, `v`) into a packed one: tokens below `cutoff` (`[S]`)
    quantised from the plain tensors, the others (at most `spec.ring` per head: the caller's rule)
    into the ring; the plain buffers are dropped."""
    kb, vb = layer.stores["k"], layer.stores["v"]
    S, G, cap, dk = kb.shape
    side, stores = new_packed(spec, S, G, cap, dk, vb.shape[-1], kb.device)
    layer.stores, layer.packed = stores, side
    n = int(lens.max()) if S else 0
    if n == 0:
        return
    ridx = torch.arange(S, device=kb.device)
    pos = layer.pbuf[:, :, :n]
    keep = (torch.arange(n, device=pos.device)[None, None, :] < lens[:, None, None]) & (pos >= cutoff[:, None, None])
    e = torch.where(keep, torch.remainder(pos, spec.ring), spec.ring)
    for ring, src in ((side.ring_k, kb), (side.ring_v, vb)):
        pad = torch.cat([ring, ring[:, :, :1]], 2)
        pad.scatter_(2, e[..., None].expand(*e.shape, src.shape[-1]), src[:, :, :n].to(ring.dtype))
        ring.copy_(pad[:, :, :spec.ring])
    rp = torch.full((S, G, spec.ring + 1), -1, dtype=torch.long, device=pos.device)
    side.ring_pos.copy_(rp.scatter_(2, e, torch.where(keep, pos, -1))[..., :spec.ring])
    quantise(layer, ridx, lens, cutoff, source=(kb[:, :, :n], vb[:, :, :n]))
