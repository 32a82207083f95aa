"""The retention cache: a transformers `Cache` of `S` sequence slots in preallocated buffers, for
every cache layout (the one cache of issue 20).

Shapes: slots (rows) `S`, KV heads `G`, capacity `cap`, head dim `d`, layers `L`, due rows `B`.

Layouts: the cache holds one `RetentionLayer` per eviction group. On a transformers model (the
per-layer K/V layout) a group is a layer with stores `k` and `v`, written by transformers'
`update`. On a reference layout model (`for_layout`: MLA, QK-norm MLA, CLA, cross-layer paths) a
group is a sharing group of the `CacheLayout` and holds every store its layers read (a latent and
its RoPE key, a shared K/V, a path's alpha and deltas, per-group inverse-RMS scalars), written by the
modules through `begin_step`/`append`; one kept set per group and eviction head, so a token dropped
from a shared store is dropped for every layer that reads it, and on a latent (`G = 1`) it is kept
or dropped whole. Everything below holds for both.

Each group holds its stores `[S, h, cap, d]` (on the K/V layout the key and value buffers, post-RoPE
keys exactly as the model wrote them) and `[S, G, cap]` absolute positions, plus any per-token state
a scorer registers (`extra`, `[S, G, cap, ...]`). Every row has its own stored length (`lengths`, one per row, the same
for every layer and KV head: a compaction keeps the same number of tokens everywhere, so tensors stay
rectangular while different heads may keep different tokens). A new token is written in place at
its row's length; a compaction gathers a row's kept tokens to the front of its own buffer; nothing
is reallocated unless the capacity is exceeded (it then doubles: the `full` policy's growth).

Ragged rows (an allocating routing: `retention.policy.routing`, PyramidKV and AdaKV). A compaction
may keep a different number of tokens in each (layer, KV head) of a row (`compact_rows` with an
`Allocation`). The buffers stay `[S, G, cap]` per layer: head `(l, g)` holds its kept tokens at the
front of the row, and the entries after them up to the row's largest count are holes, marked by
position -1 in `pbuf` (so they travel with every compaction, row move, refill and growth, as the
positions do). A row's `lengths[r]` is then the *mean* stored tokens per (layer, KV head) (what
the cadence, the meter and the states count: an allocation has the uniform compaction's mean, so
it is a whole number), and its buffer width `widths[r] = lengths[r] + holes[r]` is where new tokens
are written (the same index in every head, as before). Once a cache holds a ragged row
(`ragged`), `attention_mask()` gives a mask per query head `[S, Hq, 1, w]`, and `update` rewrites
it in place with each layer's own holes just before that layer's attention reads it (transformers
passes the one 4-D mask object to every layer unchanged; the model's code is still not patched).
Layout models (latent and shared stores) are never ragged (refused by the routing).

What the model attends to: `layer.keys` / `layer.values` (a layout model: `read(store)`) are views
`[S, G, w, d]` of the buffers with `w` the largest stored length (a static cache, `empty_like(static=True)`:
`w` is the capacity, or above `WIDTH_BLOCK` the longest row rounded up to a multiple of it, so that no
row's arithmetic depends on its neighbours' lengths: the attention kernels reduce over fixed blocks of
keys, and a block of padding only adds exact zeros); entries of a row past its own
length are padding, masked by the 4-D additive mask `attention_mask()` (a layout model: by the
position `PAD` that `layer_positions` reports for them) (None when every row has the same length, so that a single
sequence runs the very same attention call as transformers' `DynamicCache`). The model's attention
code is not patched.

A packed group (the `quant` state's packed store, `retention.runtime.packed_kv`): `layer.packed` holds
its ring of full-precision tokens and its key-chunk grids, and its stores are codes, grids and slot
indices instead of `k`/`v` (per-token buffers like any store: every path above carries them);
`update` writes a new token to the ring and returns zero-memory handles that the packed attention
reads the group through (`retention.runtime.packed_attention`), `view` dequantises, compaction and
row moves keep the ring and the chunk table in step with the kept tokens.

Positions are never compacted and stored keys are never re-rotated: the caller passes explicit
absolute `position_ids` for every forward (`set_step_positions`), because after a compaction the
model would otherwise infer positions from the (shorter) cache length and silently decode garbage.

(Over 400 lines: one class is the cache of every layout; its write, read, compaction, refill and
row-move paths keep one set of buffer invariants, which is the point of having one.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from retention.runtime.packed_attention import handle
from retention.runtime.packed_kv import PackedKV, compacted, dequantise, dequantise_at, row_bytes


PAD = 2**62  # the position padding reads as on a layout model (`layer_positions`): after every query
# A static cache's views grow in blocks of this many tokens once its capacity exceeds it (a multiple of
# it: `static_capacity`). The CPU flash-attention kernel reduces over blocks of 512 keys once there are
# at least 512 (GPU kernels over divisors of it); below that, over the whole width.
WIDTH_BLOCK = 512


def protected_positions(p: torch.Tensor, next_position: torch.Tensor, sink: int, recent: int,
                        prompt_below: torch.Tensor | None = None) -> torch.Tensor:
    """Which stored tokens a compaction must keep, from their positions alone: `[B, G, n]` bool.

    p: `[B, G, n]` int64 absolute positions (padding is the caller's to mask); next_position: `[B]`;
    sinks are `p < sink`, the window `p >= next_position - recent`, and with `prompt_below` (`[B]`)
    the positions below it (the prompt, or the counted rule's capped prompt)."""
    prot = (p < sink) | (p >= next_position[:, None, None] - recent)
    if prompt_below is not None:
        prot = prot | (p < prompt_below[:, None, None])
    return prot


def static_capacity(tokens: int) -> int:
    """The capacity of a static cache that must hold `tokens` per row: above `WIDTH_BLOCK`, rounded
    up to a multiple of it (so that every view width is)."""
    return tokens if tokens <= WIDTH_BLOCK else -(-tokens // WIDTH_BLOCK) * WIDTH_BLOCK


@dataclass(frozen=True)
class Allocation:
    """What a compaction with different counts per (layer, KV head) tells the cache (host values,
    read once per compaction by the routing): `widths` the largest count of each row of the view
    (its buffer width after the compaction), `mean` every row's mean count per (layer, KV head)."""

    widths: tuple[int, ...]
    mean: int


class RetentionLayer(DynamicLayer):
    """One eviction group (one layer on the per-layer K/V layout): every store of the group
    `stores[name]` `[S, h, cap, d]` (`k`/`v` on the K/V layout), `pbuf` `[S, G, cap]` (int64) and
    `extra` name -> `[S, G, cap, ...]`; `keys`/`values`/`positions` are views of the first `w`
    entries of every row (`keys`/`values` on the K/V layout only)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stores: dict[str, torch.Tensor] = {}
        self.pbuf = None
        self.positions: torch.Tensor | None = None
        self.extra: dict[str, torch.Tensor] = {}
        self.static = False  # views of a width that does not depend on other rows (`view_width`)
        # A packed quantised group (`retention.runtime.packed_kv`): its stores are codes, its side
        # buffers (ring, key chunks) here; `keys`/`values` are then handles (`packed_attention`).
        self.packed: PackedKV | None = None

    @property
    def kbuf(self):
        return self.stores.get("k")

    @property
    def vbuf(self):
        return self.stores.get("v")

    def allocate(self, rows: int, heads: int, cap: int, kdim: int, vdim: int, dtype, device) -> None:
        self.allocate_positions(rows, heads, cap, device)
        self.stores = {"k": torch.zeros(rows, heads, cap, kdim, dtype=dtype, device=device),
                       "v": torch.zeros(rows, heads, cap, vdim, dtype=dtype, device=device)}
        self.set_width(0)

    def allocate_positions(self, rows: int, heads: int, cap: int, device) -> None:
        self.device = device
        self.pbuf = torch.full((rows, heads, cap), -1, dtype=torch.long, device=device)
        self.stores, self.extra = {}, {}
        self.is_initialized = True

    def view_width(self, longest: int) -> int:
        """The width of the views when the longest row holds `longest` tokens: that, or in a static
        cache the capacity (at most `WIDTH_BLOCK`) or `longest` rounded up to a multiple of `WIDTH_BLOCK`."""
        if not self.static:
            return longest
        cap = self.capacity
        return cap if cap <= WIDTH_BLOCK else min(cap, max(1, -(-longest // WIDTH_BLOCK)) * WIDTH_BLOCK)

    def set_width(self, w: int) -> None:
        w = self.view_width(w)
        self.positions = self.pbuf[:, :, :w]
        if "k" in self.stores:
            self.keys, self.values = self.stores["k"][:, :, :w], self.stores["v"][:, :, :w]
        elif self.packed is not None:
            S, G = self.pbuf.shape[:2]
            pk = self.packed
            self.keys = handle(self, (S, G, w, pk.ring_k.shape[-1]), pk.spec.dtype, self.pbuf.device)
            self.values = handle(self, (S, G, w, pk.ring_v.shape[-1]), pk.spec.dtype, self.pbuf.device)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every per-token buffer (token axis 2), stores first."""
        return {**self.stores, "p": self.pbuf, **{f"x.{k}": v for k, v in self.extra.items()}}

    def set_buffers(self, bufs: dict[str, torch.Tensor]) -> None:
        self.pbuf = bufs["p"]
        self.stores = {k: v for k, v in bufs.items() if k != "p" and not k.startswith("x.")}
        self.extra = {k[2:]: v for k, v in bufs.items() if k.startswith("x.")}

    @property
    def capacity(self) -> int:
        return 0 if self.pbuf is None else self.pbuf.shape[2]

    def allocated_bytes(self) -> int:
        """Bytes of the stores (and of a packed group's ring and key chunks; positions excluded)."""
        side = 0 if self.packed is None else self.packed.allocated_bytes()
        return sum(b.numel() * b.element_size() for b in self.stores.values()) + side

    def token_bytes(self) -> int:
        """Bytes one full-precision token costs in this group's stores (one row; a packed group: in its ring)."""
        if self.packed is not None:
            return self.packed.ring_k[0, :, 0].nbytes + self.packed.ring_v[0, :, 0].nbytes
        return sum(b[0, :, 0].numel() * b.element_size() for b in self.stores.values())

    def reset(self) -> None:
        super().reset()
        self.packed = None
        self.pbuf = self.positions = None
        self.stores, self.extra = {}, {}


@dataclass
class CacheView:
    """What a scorer sees at a compaction: the `B` rows due now, padded to the longest (read-only).

    keys, values: `L` tensors `[B, G, n, d]`; entries past a row's stored length are padding.
    positions: `L` tensors `[B, G, n]` int64 absolute positions (padding -1).
    protected: `L` tensors `[B, G, n]` bool (sinks, recent window, the prompt with `protect_prompt`);
        never True on padding.
    next_position: `[B]` int64, the absolute position of each row's next query (an int is accepted).
    valid: `L` tensors `[B, G, n]` bool, False on padding (default: every entry valid).
    prompt_length: `[B]` int64 (default 0).
    slots: `[B]` int64, the engine slot of each row (default 0..B-1).
    stores: per eviction group `g`, store name -> `[B, h, n, d]` (every store the group's layers
        read, gathered with the group's kept set). Default: `{"k": keys[g], "v": values[g]}` (the
        per-layer K/V layout, where group `g` is layer `g`).
    groups: the layers of each eviction group (default `(g,)`: one group per layer).
    layout: the `retention.models.layouts.CacheLayout` of the cache (None: per-layer K/V).
    `keys` / `values` hold per-head, per-layer tensors only on the per-layer K/V layout; on a
    latent or shared-store layout they are empty lists and a scorer reads `stores`.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: list[torch.Tensor]
    protected: list[torch.Tensor]
    next_position: torch.Tensor | int
    valid: list[torch.Tensor] | None = None
    prompt_length: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    extra: list[dict[str, torch.Tensor]] = field(default_factory=list)
    stores: list[dict[str, torch.Tensor]] | None = None
    groups: list[tuple[int, ...]] | None = None
    layout: object | None = None

    def __post_init__(self):
        B, dev = self.positions[0].shape[0], self.positions[0].device
        if self.stores is None:
            self.stores = [{"k": k, "v": v} for k, v in zip(self.keys, self.values, strict=True)]
        if self.groups is None:
            self.groups = [(g,) for g in range(len(self.positions))]
        if not isinstance(self.next_position, torch.Tensor):
            self.next_position = torch.full((B,), int(self.next_position), dtype=torch.long, device=dev)
        if self.valid is None:
            self.valid = [torch.ones_like(p, dtype=torch.bool) for p in self.positions]
        if self.prompt_length is None:
            self.prompt_length = torch.zeros(B, dtype=torch.long, device=dev)
        if self.slots is None:
            self.slots = torch.arange(B, device=dev)

    @property
    def num_layers(self) -> int:
        """Eviction groups of the view (layers on the per-layer K/V layout)."""
        return len(self.positions)

    @property
    def uniform_next_position(self) -> int | None:
        """The next position when every row shares it (a single sequence), else None."""
        t = self.next_position
        return int(t[0]) if bool((t == t[0]).all()) else None


class RetentionCache(Cache):
    """A transformers `Cache` of `RetentionLayer`s over `S` rows that a policy compacts between steps.

    Use: before every forward, `set_step_positions(position_ids)` (`[S, q]`); after it, the policy may
    call `view(...)` and `compact_rows(...)`. `capacity`: tokens preallocated per row (grown by
    doubling when exceeded); None starts at the first write's size. With no compaction and one row
    this cache hands the model exactly what `DynamicCache` would, which the exactness tests hold.

    `for_layout(layout)` builds the cache of a reference layout model (`retention.models.arch`): one
    `RetentionLayer` per eviction group of the layout holding every store of the group. Its modules
    call `begin_step` (instead of `set_step_positions`), `append`/`read` a store by name,
    `layer_positions` (padding reads as position `PAD`, after every query, so the causal mask hides
    it), `note_attention` and `scratch` (per-forward values handed down a cross-layer path).
    """

    def __init__(self, num_layers: int, capacity: int | None = None):
        super().__init__(layers=[RetentionLayer() for _ in range(num_layers)])
        self.capacity = capacity
        self.lengths: list[int] = []  # stored tokens of each row (host copy: no device sync to read it)
        # Ragged rows (module doc): hole entries per (layer, head) of each row (0 unless an
        # allocation compacted it), whether any row was ever ragged, the mask the next forward uses.
        self.holes: list[int] = []
        self.ragged = False
        self._mask: torch.Tensor | None = None
        self._mask_widths: torch.Tensor | None = None  # [S] each row's width in that forward
        self.slots: list[int] = []  # the engine slot each row holds (scorers key per-slot state by it)
        self.prompt_lengths: list[int] = []  # prompt tokens of each row's sequence (the prompt rule)
        self._step_positions: torch.Tensor | None = None
        self._write_at: list[int] = []
        self._write_idx: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, indices) of a scattered write
        self._step_widths: torch.Tensor | None = None  # [S] widths after this forward's write (a packed cache)
        # Layout models only (`for_layout`): the layout, its eviction groups, and per step the
        # attention each group's stored tokens received (`collect_attention`), padded positions.
        self.layout = None
        self.groups: list[tuple[int, ...]] = [(i,) for i in range(num_layers)]
        self.group_of_layer = {i: i for i in range(num_layers)}
        self.group_of_store: dict[str, int] = {}
        self.collect_attention = False
        self.attention: list[torch.Tensor | None] = []
        self.scratch: dict = {}
        self._layer_pos: list[torch.Tensor] = []

    @classmethod
    def for_layout(cls, layout, capacity: int | None = None) -> RetentionCache:
        """The cache of a `retention.models.layouts.CacheLayout` (a reference layout model): one group per
        sharing group, positions `[S, layout.kv_heads, cap]`, every store `[S, heads, cap, dim]`."""
        groups = layout.groups()
        c = cls(len(groups), capacity)
        c.layout, c.groups = layout, groups
        c.group_of_layer = {layer: g for g, members in enumerate(groups) for layer in members}
        c.group_of_store = {s.name: c.group_of_layer[s.writer] for s in layout.stores}
        return c

    @property
    def is_layout(self) -> bool:
        return self.layout is not None

    # -- writing ---------------------------------------------------------------------------------
    def set_step_positions(self, position_ids: torch.Tensor) -> None:
        """Absolute positions `[S, q]` of the tokens the next forward appends (one row per slot)."""
        self._step_positions = position_ids

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def widths(self) -> list[int]:
        """Each row's buffer width: where its next token is written (= `lengths` unless ragged)."""
        return [n + h for n, h in zip(self.lengths, self.holes, strict=True)]

    def _init_rows(self, R: int) -> None:
        self.lengths, self.holes = [0] * R, [0] * R
        self.slots = self.slots if len(self.slots) == R else list(range(R))
        self.prompt_lengths = self.prompt_lengths if len(self.prompt_lengths) == R else [0] * R

    def _ensure(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        first = self.layers[0]
        if first.pbuf is None:
            R, G, _, dk = key_states.shape
            cap = max(self.capacity or 0, need)
            for layer in self.layers:
                layer.allocate(R, G, cap, dk, value_states.shape[-1], key_states.dtype, key_states.device)
            self._init_rows(R)
        elif need > first.capacity:
            self._grow(max(2 * first.capacity, need))

    def _grow(self, cap: int) -> None:
        for layer in self.layers:
            new = {}
            for name, b in layer.buffers().items():
                nb = torch.full((*b.shape[:2], cap, *b.shape[3:]), -1 if name == "p" else 0, dtype=b.dtype,
                                device=b.device)
                nb[:, :, : b.shape[2]] = b
                new[name] = nb
            layer.set_buffers(new)
            layer.set_width(max(self.widths, default=0))

    @staticmethod
    def _write(buf: torch.Tensor, x: torch.Tensor, at: list[int]) -> None:
        """Write `x` `[S, h, q, ...]` into `buf` at each row's own index `at[r]`."""
        q = x.shape[2]
        if all(a == at[0] for a in at):  # every row at the same length: one slice write
            buf[:, :, at[0]:at[0] + q] = x
            return
        if q != 1:  # rows at different lengths (decode, q = 1): scatter each row's token at its own index
            raise RuntimeError("a multi-token forward needs every row at the same stored length")
        r = torch.arange(len(at), device=buf.device)
        buf[r, :, torch.tensor(at, device=buf.device)] = x[:, :, 0]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write the `q` new tokens of every row at its own length; return the `[S, G, w, d]` views."""
        if self._step_positions is None:
            raise RuntimeError("RetentionCache.update called without set_step_positions()")
        q = key_states.shape[2]
        if layer_idx == 0:
            self._ensure(key_states, value_states, max(self.widths, default=0) + q)
            if key_states.shape[0] != self.rows:
                raise RuntimeError(f"forward of {key_states.shape[0]} rows on a cache of {self.rows}")
            self._write_at = at = self.widths
            if self.ragged and (self._mask is None or self._mask.shape[-1] != self.layers[0].view_width(max(at) + q)):
                raise RuntimeError("a ragged cache needs its attention_mask() for every forward")
            if any(a != at[0] for a in at):  # rows at different widths: their write indices, once per forward
                dev = self.layers[0].pbuf.device
                self._write_idx = (torch.arange(self.rows, device=dev), torch.tensor(at, device=dev))
            if self.layers[0].packed is not None:  # what a packed attention masks by: widths after the write
                self._step_widths = torch.tensor([a + q for a in at], device=self.layers[0].pbuf.device)
        layer = self.layers[layer_idx]
        pos = self._step_positions.to(layer.pbuf.device)[:, None, :].expand(-1, key_states.shape[1], -1)
        at = self._write_at
        if layer.packed is None:
            writes = {"k": key_states, "v": value_states}
        else:  # a packed group: the new tokens go to its ring, in full precision (`packed_kv`)
            if q > layer.packed.spec.ring:
                raise RuntimeError(f"a packed cache takes at most {layer.packed.spec.ring} tokens per forward")
            layer.packed.write(self._step_positions, key_states, value_states)
            layer.packed.step_widths, layer.packed.step_pos = self._step_widths, self._step_positions
            writes = {"slot": torch.zeros_like(pos, dtype=layer.stores["slot"].dtype)}
        if all(a == at[0] for a in at):  # every row at the same length: one slice write
            s = slice(at[0], at[0] + q)
            for name, x in writes.items():
                layer.stores[name][:, :, s] = x
            layer.pbuf[:, :, s] = pos
            for b in layer.extra.values():  # per-token state of a new token starts at zero
                b[:, :, s] = 0
        else:  # rows at different lengths (decode, q = 1): scatter each row's token at its own index
            if q != 1:
                raise RuntimeError("a multi-token forward needs every row at the same stored length")
            r, idx = self._write_idx  # built once per forward (layer 0)
            for name, x in writes.items():
                layer.stores[name][r, :, idx] = x[:, :, 0]
            layer.pbuf[r, :, idx] = pos[:, :, 0]
            for b in layer.extra.values():
                b[r, :, idx] = 0
        layer.set_width(max(at) + q)
        if self._mask is not None:
            self._layer_mask(layer)
        if layer_idx == len(self.layers) - 1:
            self.lengths = [n + q for n in self.lengths]
            self._mask = None  # used up: the next forward asks for its own
        return layer.keys, layer.values

    def _layer_mask(self, layer: RetentionLayer) -> None:
        """Write `layer`'s own padding and holes into the mask `[S, Hq, 1, w]` of this forward (each
        query head reads its KV head's entries: query head `h` belongs to KV head `h // (Hq / G)`)."""
        S, Hq, _, w = self._mask.shape
        G = layer.pbuf.shape[1]
        stored = (torch.arange(w, device=layer.pbuf.device) < self._mask_widths[:, None])[:, None, :]  # [S, 1, w]
        valid = stored & (layer.pbuf[:, :, :w] >= 0)  # [S, G, w]: holes hold position -1
        hidden = torch.tensor(torch.finfo(self._mask.dtype).min, dtype=self._mask.dtype, device=valid.device)
        self._mask.view(S, G, Hq // G, 1, w).copy_(torch.where(valid, 0.0, hidden)[:, :, None, None, :])

    # -- the layout models' API (`retention.models.arch.modules`) ---------------------------------------
    def begin_step(self, position_ids: torch.Tensor) -> None:
        """A layout model's forward starts: its `q` tokens per row `[S, q]` at these absolute
        positions are written at each row's length (positions now, stores by `append`)."""
        self.scratch = {}
        self._step_positions = position_ids
        R, q = position_ids.shape
        first = self.layers[0]
        need = max(self.widths, default=0) + q
        if first.pbuf is None:
            cap = max(self.capacity or 0, need)
            for layer in self.layers:
                layer.allocate_positions(R, self.layout.kv_heads, cap, position_ids.device)
            self._init_rows(R)
        elif need > first.capacity:
            self._grow(max(2 * first.capacity, need))
        if R != self.rows:
            raise RuntimeError(f"forward of {R} rows on a cache of {self.rows}")
        at = self._write_at = list(self.lengths)
        self.lengths = [a + q for a in at]
        w = first.view_width(max(self.lengths))
        pos = position_ids[:, None, :].expand(-1, self.layout.kv_heads, -1)
        valid = None if all(n == w for n in self.lengths) else self._valid(w)[:, None, :]
        self._layer_pos = []
        for layer in self.layers:
            self._write(layer.pbuf, pos, at)
            for b in layer.extra.values():  # per-token state of a new token starts at zero
                self._write(b, b.new_zeros(R, b.shape[1], q, *b.shape[3:]), at)
            layer.set_width(w)
            self._layer_pos.append(layer.positions if valid is None else layer.positions.masked_fill(~valid, PAD))
        self.attention = [None] * len(self.layers)

    def append(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Write store `name`'s `x` `[S, h, q, d]` for this step; return all it holds `[S, h, w, d]`
        (a row's entries past its length are padding: stale values at position `PAD`)."""
        layer = self.layers[self.group_of_store[name]]
        buf = layer.stores.get(name)
        if buf is None:
            S, h, _, d = x.shape
            buf = layer.stores[name] = torch.zeros(S, h, layer.capacity, d, dtype=x.dtype, device=x.device)
        self._write(buf, x, self._write_at)
        return buf[:, :, :layer.positions.shape[-1]]

    def read(self, name: str) -> torch.Tensor:
        """Everything store `name` holds `[S, h, w, d]`."""
        layer = self.layers[self.group_of_store[name]]
        return layer.stores[name][:, :, :layer.positions.shape[-1]]

    def layer_positions(self, layer: int) -> torch.Tensor:
        """Absolute positions `[S, G, w]` of what `layer` attends to; padding at `PAD`."""
        return self._layer_pos[self.group_of_layer[layer]]

    def note_attention(self, layer: int, probs: torch.Tensor) -> None:
        """`layer`'s attention probabilities `[S, X, r, q, w]` (X groups of r query heads), summed
        over the query heads to the eviction heads `[S, G, q, w]` and over the group's layers, kept
        for this step in `attention[group]` when `collect_attention` (attention-reading scorers)."""
        if not self.collect_attention:
            return
        summed = probs.sum(2)
        b, x, q, n = summed.shape
        g = self.layout.kv_heads
        summed = summed if x == g else summed.view(b, g, x // g, q, n).sum(2)
        i = self.group_of_layer[layer]
        self.attention[i] = summed if self.attention[i] is None else self.attention[i] + summed

    def truncate(self, n: int) -> None:
        """Forget every row's tokens after the first `n` (benchmarks rewind a step; not ragged rows)."""
        if any(self.holes):
            raise RuntimeError("truncate() of a ragged cache")
        self.lengths = [min(x, n) for x in self.lengths]
        for layer in self.layers:
            layer.set_width(max(self.lengths, default=0))

    def attention_mask(self, q: int, dtype: torch.dtype, query_heads: int = 1) -> torch.Tensor | None:
        """The additive 4-D mask `[S, 1, q, w]` of the next forward (after its `q` tokens are written)
        that hides each row's padding; None when every row will have the same length (no padding)
        and on a layout model (its modules mask padding by position). A ragged cache: `[S, Hq, 1, w]`
        (`query_heads` = Hq), filled per layer by `update` (module doc)."""
        new = [n + q for n in self.widths]
        first = self.layers[0]
        static = first.pbuf is not None and first.static
        if self.ragged:
            if q != 1:
                raise RuntimeError("ragged rows are decoded one token at a time")
            if max(new) > first.capacity:  # grow now, so that the mask has the width of the views it masks
                self._grow(max(2 * first.capacity, max(new)))
            dev = first.pbuf.device
            self._mask_widths = torch.tensor(new, device=dev)
            self._mask = torch.zeros(len(new), query_heads, 1, first.view_width(max(new)), dtype=dtype, device=dev)
            return self._mask
        if self.is_layout or (not static and all(n == new[0] for n in new)):
            return None
        if q != 1:
            raise RuntimeError("padded rows are decoded one token at a time")
        dev = first.pbuf.device
        w = first.view_width(max(new))
        valid = torch.arange(w, device=dev)[None, :] < torch.tensor(new, device=dev)[:, None]
        mask = torch.zeros(len(new), 1, 1, w, dtype=dtype, device=dev)
        return mask.masked_fill_(~valid[:, None, None, :], torch.finfo(dtype).min)

    # -- reading ---------------------------------------------------------------------------------
    def valid_mask(self) -> torch.Tensor:
        """`[S, w]` bool over the views' width: entry `j` of row `r` is within its width (`j < widths[r]`;
        a ragged row's holes are within it: `layer_valid`)."""
        first = self.layers[0]
        return self._valid(first.view_width(max(self.widths, default=0)))

    def _valid(self, w: int) -> torch.Tensor:
        dev = self.layers[0].pbuf.device
        return torch.arange(w, device=dev)[None, :] < torch.tensor(self.widths, device=dev)[:, None]

    def layer_valid(self, layer: int) -> torch.Tensor:
        """`[S, G, w]` bool: entry `j` of head `g` of row `r` of `layer` holds a stored token."""
        ly = self.layers[layer]
        valid = self.valid_mask()[:, None, :].expand(-1, ly.pbuf.shape[1], -1)
        return valid & (ly.positions >= 0) if self.ragged else valid

    def written_slots(self) -> torch.Tensor:
        """`[S, q]` int64: the buffer index, in each row, of the `q` tokens the last forward wrote
        (read it after the forward and before any compaction)."""
        dev = self.layers[0].pbuf.device
        at = torch.tensor(self._write_at, dtype=torch.long, device=dev)
        q = self.widths[0] - self._write_at[0] if self.lengths else 0
        return at[:, None] + torch.arange(q, device=dev)[None, :]

    def stored_lengths(self) -> list[int]:
        """Stored tokens per layer of a single-row cache (every layer and head holds the same; a
        ragged row: its mean)."""
        return [max(self.lengths, default=0)] * (self.layout.layers if self.is_layout else len(self.layers))

    def row_lengths(self) -> list[int]:
        """Stored tokens of each row."""
        return list(self.lengths)

    def allocated_bytes(self) -> int:
        """Bytes of the store buffers (all rows, all groups)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def stored_bytes(self) -> int:
        """Bytes of the stored tokens' tensors (every row's length, every store; positions,
        per-token scorer state, holes and free buffer space excluded; a ragged row's `lengths` is its
        mean per (layer, head), so this is exact where every layer's token costs the same)."""
        if self.layers[0].pbuf is None:
            return 0
        if self.layers[0].packed is not None:  # a packed cache: what its tensors hold (`packed_kv.row_bytes`)
            dev = self.layers[0].pbuf.device
            ridx, lens = torch.arange(self.rows, device=dev), torch.tensor(self.widths, device=dev)
            return int(sum(row_bytes(layer, ridx, lens).sum() for layer in self.layers))
        return sum(layer.token_bytes() for layer in self.layers) * sum(self.lengths)

    nbytes = stored_bytes

    def view(self, next_position, sink: int = 0, recent: int = 0, rows: list[int] | None = None,
             prompt_length=None, protect_prompt: bool = False, slots=None, prompt_below=None) -> CacheView:
        """A `CacheView` over `rows` (default all): sinks (`position < sink`), the `recent` newest
        positions (`>= next_position - recent`) and, with `protect_prompt`, the prompt protected;
        `prompt_below` (per row or one int) protects the positions below it instead (the counted
        prompt rule's capped prompt, `Cadence.protected_prompt`).
        next_position, prompt_length, slots: per row of the view (`[B]`) or one int for all."""
        rows = list(range(self.rows)) if rows is None else list(rows)
        dev = self.layers[0].pbuf.device
        widths = self.widths
        n = max(widths[r] for r in rows)
        whole = rows == list(range(self.rows))
        ridx = torch.tensor(rows, device=dev)
        lens = torch.tensor([widths[r] for r in rows], device=dev)
        B = len(rows)

        def per_row(x, default):
            x = default if x is None else x
            if isinstance(x, torch.Tensor):
                return x.to(dev)
            if isinstance(x, (list, tuple)):
                return torch.tensor(x, dtype=torch.long, device=dev)
            return torch.full((B,), int(x), dtype=torch.long, device=dev)

        t = per_row(next_position, 0)
        plen = per_row(prompt_length, 0)
        below = None if prompt_below is None else per_row(prompt_below, 0)
        slots = per_row(slots, 0) if slots is not None else ridx.clone()
        valid_1 = torch.arange(n, device=dev)[None, :] < lens[:, None]  # [B, n]

        def take(b):
            # Always a copy (index_select copies; a slice of every row would be the live buffer): a
            # scorer that writes into its view must not change what the cache holds.
            b = b[:, :, :n]
            return b.clone() if whole else b.index_select(0, ridx)

        stores, positions, protected, valid, extra = [], [], [], [], []
        for layer in self.layers:
            p = take(layer.pbuf)
            ok = valid_1[:, None, :].expand_as(p)
            if self.ragged:
                ok = ok & (p >= 0)  # a ragged row's holes
            p = p.masked_fill(~ok, -1)
            prot = protected_positions(p, t, sink, recent, plen if protect_prompt else below)
            if layer.packed is None:
                stores.append({k: take(v) for k, v in layer.stores.items()})
            else:  # a packed group: its tokens dequantised, as the attention reads them
                kk, vv = dequantise(layer, None if whole else ridx, 0, n)
                stores.append({"k": kk, "v": vv})
            positions.append(p)
            protected.append(prot & ok)
            valid.append(ok)
            extra.append({k: take(v) for k, v in layer.extra.items()})
        keys = [] if self.is_layout else [s["k"] for s in stores]
        values = [] if self.is_layout else [s["v"] for s in stores]
        return CacheView(keys, values, positions, protected, t, valid, plen, slots, extra, stores=stores,
                         groups=list(self.groups), layout=self.layout)

    def layer_keys(self, layer: int) -> torch.Tensor:
        """`[S, G, w, d]` the keys `layer` holds (its view; a packed group: dequantised, a full copy,
        for the scorers that read every key every step: H2O)."""
        ly = self.layers[layer]
        return ly.keys if ly.packed is None else dequantise(ly, None, 0, ly.positions.shape[-1])[0]

    def token_values(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        """`[S, G, q, dv]` the values `layer` holds at entries `idx` `[S, G, q]` (a packed group: dequantised)."""
        ly = self.layers[layer]
        if ly.packed is not None:
            return dequantise_at(ly, idx)[1]
        return ly.vbuf.gather(2, idx[..., None].expand(*idx.shape, ly.vbuf.shape[-1]))

    # -- evicting and moving rows ----------------------------------------------------------------
    def compact_rows(self, rows: list[int], keep: torch.Tensor, allocation: Allocation | None = None) -> None:
        """Keep only the stored tokens at `keep` of each of `rows` (indices into the row's buffer):
        `[B, G, k]` shared by all groups or `[L, B, G, k]` per group (layer), sorted ascending so
        that tokens stay in position order. Every store, the positions and the per-token state of a
        group are gathered together to the front of each row's own buffer. A store with more heads
        than the eviction unit (QK-norm MLA's per-group inverse RMS under a one-head latent) keeps
        the unit's tokens in every head. With an `allocation`, `keep` is `[L, B, G, m]` with each
        head's kept indices first and -1 after them: those entries become holes (module doc)."""
        rows = list(rows)
        k = keep.shape[-1]
        dev = self.layers[0].pbuf.device
        whole = rows == list(range(self.rows))
        ridx = torch.tensor(rows, device=dev)
        widths = self.widths
        n = max(widths[r] for r in rows)
        for i, layer in enumerate(self.layers):
            kp = (keep if keep.dim() == 3 else keep[i]).to(dev)
            hole = None if allocation is None else kp < 0
            kp = kp if hole is None else kp.clamp(min=0)
            new = {}
            for name, b in layer.buffers().items():
                src = b[:, :, :n] if whole else b.index_select(0, ridx)[:, :, :n]
                kb = kp if kp.shape[1] == b.shape[1] else kp.expand(-1, b.shape[1], -1)
                idx = kb.reshape(*kb.shape, *([1] * (b.dim() - 3))).expand(*kb.shape, *b.shape[3:])
                new[name] = torch.gather(src, 2, idx)
            if hole is not None:
                new["p"] = new["p"].masked_fill(hole, -1)
            for name, b in layer.buffers().items():
                if whole:
                    b[:, :, :k] = new[name]
                else:
                    b[ridx, :, :k] = new[name]
            if layer.packed is not None:  # its ring and key chunks follow the kept tokens
                compacted(layer, None if whole else ridx, k)
        for j, r in enumerate(rows):
            if allocation is None:
                self.lengths[r], self.holes[r] = k, 0
            else:
                self.lengths[r], self.holes[r] = allocation.mean, allocation.widths[j] - allocation.mean
        self.ragged = self.ragged or allocation is not None
        w = max(self.widths)
        for layer in self.layers:
            layer.set_width(w)

    def compact(self, keep: torch.Tensor) -> None:
        """Evict everything but `keep` in every row: `[S, G, k]` shared by all layers, or `[L, S, G, k]`."""
        self.compact_rows(list(range(self.rows)), keep)

    def add_extra(self, layer_idx: int, name: str, tail: tuple = (), dtype=torch.float32) -> torch.Tensor:
        """Register (once) per-token state `[S, G, cap, *tail]` (zeros) of group (layer) `layer_idx`
        that follows every compaction, row move, refill and growth exactly like the stores."""
        layer = self.layers[layer_idx]
        if name not in layer.extra:
            S, G, cap = layer.pbuf.shape
            layer.extra[name] = torch.zeros(S, G, cap, *tail, dtype=dtype, device=layer.pbuf.device)
        return layer.extra[name]

    def load_row(self, row: int, src: RetentionCache, src_row: int = 0) -> None:
        """Replace `row` with row `src_row` of `src` (a finished prefill): its stored tokens, positions
        and per-token state. Entries past the new length keep stale data, masked as padding."""
        n = src.widths[src_row]
        if n > self.layers[0].capacity:
            self._grow(max(2 * self.layers[0].capacity, n))
        for dst_l, src_l in zip(self.layers, src.layers):
            if (dst_l.packed is None) != (src_l.packed is None):
                raise RuntimeError("a packed and a plain cache do not exchange rows")
            if dst_l.packed is not None:
                dst_l.packed.load_row(row, src_l.packed, src_row)
            S, G, cap = dst_l.pbuf.shape
            for name, b in src_l.extra.items():
                if name not in dst_l.extra:
                    dst_l.extra[name] = torch.zeros(S, G, cap, *b.shape[3:], dtype=b.dtype, device=b.device)
            for name, b in src_l.stores.items():
                if name not in dst_l.stores:
                    dst_l.stores[name] = torch.zeros(S, b.shape[1], cap, *b.shape[3:], dtype=b.dtype, device=b.device)
            src_bufs = src_l.buffers()
            for name, b in dst_l.buffers().items():
                sb = src_bufs.get(name)
                if sb is None:
                    b[row].zero_()
                else:
                    b[row, :, :n] = sb[src_row, :, :n]
        self.lengths[row], self.holes[row] = src.lengths[src_row], src.holes[src_row]
        self.ragged = self.ragged or src.ragged
        self.slots[row], self.prompt_lengths[row] = src.slots[src_row], src.prompt_lengths[src_row]
        w = max(self.widths)
        for layer in self.layers:
            layer.set_width(w)

    def select_rows(self, rows: list[int]) -> None:
        """Keep only `rows`, in this order (drops finished slots when no sequence is left to start)."""
        dev = self.layers[0].pbuf.device
        ridx = torch.tensor(rows, device=dev)
        for layer in self.layers:
            layer.set_buffers({k: b.index_select(0, ridx) for k, b in layer.buffers().items()})
            if layer.packed is not None:
                layer.packed = layer.packed.rows(ridx)
        self.lengths = [self.lengths[r] for r in rows]
        self.holes = [self.holes[r] for r in rows]
        self.slots = [self.slots[r] for r in rows]
        self.prompt_lengths = [self.prompt_lengths[r] for r in rows]
        w = max(self.widths, default=0)
        for layer in self.layers:
            layer.set_width(w)

    def reachable_widths(self) -> list[int]:
        """The view widths the forwards of a static cache can have from now on: the current one,
        then one more block of `WIDTH_BLOCK` at a time up to the capacity."""
        first = self.layers[0]
        w, cap = first.positions.shape[-1], first.capacity
        return sorted({first.view_width(n) for n in range(max(w, 1), cap + 1, WIDTH_BLOCK)} | {first.view_width(cap)})

    def take_rows(self, rows: list[int]) -> RetentionCache:
        """A new cache of `rows` only, in this order (copies of their buffers; this cache unchanged):
        the engine's tail, which decodes its last sequences on fewer rows."""
        c = copy.copy(self)
        c.layers = [copy.copy(layer) for layer in self.layers]
        c.select_rows(rows)
        return c

    def release_row(self, row: int) -> None:
        """`row` holds no sequence now (a padding row of a static step): nothing stored in it."""
        self.lengths[row], self.holes[row] = 0, 0

    @classmethod
    def empty_like(cls, other: RetentionCache, rows: int, capacity: int, static: bool = False) -> RetentionCache:
        """A cache of `rows` empty rows with `other`'s geometry (layout, stores), `capacity` tokens
        preallocated; `static`: the views' width never depends on which rows are long
        (`RetentionLayer.view_width`; padding masked): the engine's static decode step."""
        c = cls.for_layout(other.layout, capacity) if other.is_layout else cls(len(other.layers), capacity)
        c.collect_attention = other.collect_attention
        for layer, ol in zip(c.layers, other.layers):
            layer.allocate_positions(rows, ol.pbuf.shape[1], capacity, ol.pbuf.device)
            layer.stores = {name: torch.zeros(rows, b.shape[1], capacity, *b.shape[3:], dtype=b.dtype, device=b.device)
                            for name, b in ol.stores.items()}
            layer.static = static
            layer.packed = None if ol.packed is None else ol.packed.empty(rows)
            layer.set_width(0)
        c.lengths, c.holes, c.slots, c.prompt_lengths = [0] * rows, [0] * rows, list(range(rows)), [0] * rows
        return c
