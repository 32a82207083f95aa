"""The packed quantised store (retention.runtime.packed_kv) and its chunked attention
(retention.runtime.packed_attention): codes round-trip, the grid's bound, attention against a plain
float64 attention over the dequantised tensors, the kept-set invariants through compaction and row
moves, bytes from the tensors, and memory really below the model-dtype cache's."""

from __future__ import annotations

import math

import pytest
import torch

from retention.runtime.cache import RetentionCache
from retention.runtime import packed_attention
from retention.runtime.packed_attention import attend
from retention.runtime.packed_kv import (CHUNK, PackSpec, chunk_grid, decode, dequantise, encode, pack, row_bytes,
                                         to_packed, token_grid, unpack)


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2 ** bits, (3, 2, 7, 16), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 7, 16 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)
    if bits == 4:  # two codes a byte, the even channel in the low nibble
        assert torch.equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))


@pytest.mark.parametrize("bits", [8, 4])
def test_codes_decode_within_half_a_step_of_their_float16_grid(bits):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, 32, generator=g, dtype=torch.float64) * torch.linspace(0.05, 40, 32, dtype=torch.float64) + 3
    spec = PackSpec(bits, 8, "channel", 12, torch.float64)
    levels = 2 ** bits - 1
    grouped = token_grid(x, 8, bits).repeat_interleave(8, dim=-2)  # per token over groups of 8 channels
    new = torch.rand(2, 3, 40, generator=g) < 0.8
    cidx = torch.where(new, (new.long().cumsum(-1) - 1) // 8, 0)
    chunks = chunk_grid(x, new, cidx, int(cidx.max()) + 1, bits)
    per_channel = torch.gather(chunks, 2, cidx[..., None, None].expand(*cidx.shape, 32, 2))
    for grid, mask in ((grouped, torch.ones_like(new)), (per_channel, new)):
        s, lo = grid[..., 0].double(), grid[..., 1].double()
        err = (decode(encode(x, grid, bits), grid, spec) - x).abs()
        assert bool((err <= s / 2 + 1e-12 * x.abs())[mask].all())
    # The grid is the min-max one rounded outward to float16: never coarser than 2^-8 beyond it.
    xs = x.view(2, 3, 40, 4, 8)
    hi, lo = xs.amax(-1), xs.amin(-1)
    s16 = token_grid(x, 8, bits)[..., 0].double()
    assert bool((s16 * levels >= hi - lo).all())
    assert bool((s16 * levels <= (hi - lo + lo.abs() * 2 ** -9) * (1 + 2 ** -8)).all())


def _packed_cache(S=3, L=2, G=2, n=600, d=16, dtype=torch.float64, bits=8, keys="channel", residual=40, group=8,
                  seed=0):
    """A cache of `S` rows of `n` tokens turned packed: every token older than the `residual` newest quantised."""
    g = torch.Generator().manual_seed(seed)
    cache = RetentionCache(L, capacity=n + 8)
    cache.set_step_positions(torch.arange(n).expand(S, n))
    plain = []
    for i in range(L):
        k = (torch.randn(S, G, n, d, generator=g) * 2).to(dtype)
        v = torch.randn(S, G, n, d, generator=g).to(dtype)
        cache.update(k, v, i)
        plain.append((k, v))
    spec = PackSpec(bits, group, keys, residual + group, dtype)
    for layer in cache.layers:
        to_packed(layer, spec, torch.full((S,), n), torch.full((S,), n - residual))
        layer.set_width(n)
    return cache, plain, spec


def _reference(query, keys, values, valid, scaling):
    """Plain float64 attention `[S, q, Hq, d]` over `keys`/`values` `[S, G, w, d]` where `valid` `[S, G, q, w]`."""
    S, Hq, q, d = query.shape
    r = Hq // keys.shape[1]
    k, v = keys.double().repeat_interleave(r, 1), values.double().repeat_interleave(r, 1)
    s = (query.double() @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~valid.repeat_interleave(r, 1), -math.inf)
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("flash", [True, False], ids=["cpu-flash", "plain-softmax"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("keys,bits", [("channel", 8), ("token", 4)])
def test_chunked_attention_equals_plain_attention_over_the_dequantised_tensors(dtype, tol, keys, bits, flash,
                                                                                monkeypatch):
    """Rows of different lengths (a compaction), GQA (3 query heads per KV head), three chunks of
    keys: the chunked attention is the float64 attention over what the store dequantises to, through
    the CPU flash kernel and through the plain softmax other devices run (bfloat16: within its rounding,
    each chunk's output rounded before the merge)."""
    if not flash:
        monkeypatch.setattr(packed_attention, "_FLASH_CPU", None)
    S, G, r, d, n = 3, 2, 3, 16, 2 * CHUNK + 40
    cache, _, spec = _packed_cache(S=S, G=G, n=n, d=d, dtype=dtype, bits=bits, keys=keys)
    g = torch.Generator().manual_seed(5)
    for row, k in ((1, n - 70), (2, n - 100)):  # rows 1, 2 compacted to fewer tokens (some of the ring's too)
        keep = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(G)])[None]
        cache.compact_rows([row], keep)
    pos = torch.tensor([[n], [n], [n]])
    cache.set_step_positions(pos)
    for i, layer in enumerate(cache.layers):
        kq = torch.randn(S, G, 1, d, generator=g).to(dtype)
        cache.update(kq, kq.flip(-1), i)
        query = torch.randn(S, G * r, 1, d, generator=g).to(dtype)
        got = attend(query, layer, d ** -0.5)
        w = layer.positions.shape[-1]
        kk, vv = dequantise(layer, None, 0, w)
        widths = layer.packed.step_widths[:, None, None]  # after this forward's write
        valid = (torch.arange(w)[None, None, :] < widths) & (layer.positions >= 0)
        want = _reference(query, kk, vv, valid[:, :, None, :], d ** -0.5)
        assert got.shape == (S, 1, G * r, d) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def _by_position(cache, row):
    """{(layer, head, position): (key, value)} of every token row `row` holds (dequantised)."""
    out = {}
    w = cache.widths[row]
    for i, layer in enumerate(cache.layers):
        k, v = dequantise(layer, torch.tensor([row]), 0, w)
        for h in range(k.shape[1]):
            for j in range(w):
                p = int(layer.pbuf[row, h, j])
                if p >= 0:
                    out[(i, h, p)] = (k[0, h, j], v[0, h, j])
    return out


def _same_tokens(before, after):
    assert set(after) <= set(before)
    for key, (k, v) in after.items():
        assert torch.equal(k, before[key][0]) and torch.equal(v, before[key][1]), key


def _independent_bytes(cache, row):
    total = 0
    for ly in cache.layers:
        w = cache.widths[row]
        slot, pos = ly.stores["slot"][row, :, :w], ly.pbuf[row, :, :w]
        quant = (slot > 0) & (pos >= 0)
        entry = sum(ly.stores[n][row, 0, 0].nbytes for n in ("qk", "qv", "sv", "sk") if n in ly.stores)
        total += int(quant.sum()) * entry
        total += int((ly.packed.ring_pos[row] >= 0).sum()) * (ly.packed.ring_k[row, 0, 0].nbytes + ly.packed.ring_v[row, 0, 0].nbytes)
        if ly.packed.table is not None:
            total += sum(len(set(slot[h][quant[h]].tolist())) for h in range(slot.shape[0])) * ly.packed.table[row, 0, 0].nbytes
    return total


@pytest.mark.parametrize("keys", ["channel", "token"])
def test_compaction_and_row_moves_keep_every_token_and_its_bytes(keys):
    """Compaction (different kept sets per head), quantising again, growth, take_rows, select_rows
    and load_row: every kept token dequantises to what it did before, and the bytes recounted from
    the tensors follow (`row_bytes`)."""
    cache, _, spec = _packed_cache(S=3, n=120, keys=keys, residual=20, group=8)
    g = torch.Generator().manual_seed(2)
    before = {r: _by_position(cache, r) for r in range(3)}
    keep = torch.stack([torch.stack([torch.randperm(120, generator=g)[:50].sort().values for _ in range(2)]) for _ in range(2)])
    cache.compact_rows([0, 2], keep)
    for r in range(3):
        _same_tokens(before[r], _by_position(cache, r))
    ridx, lens = torch.arange(3), torch.tensor(cache.widths)
    got = sum(row_bytes(ly, ridx, lens) for ly in cache.layers)
    assert got.tolist() == [_independent_bytes(cache, r) for r in range(3)]
    from retention.runtime.packed_kv import quantise

    mid = {r: _by_position(cache, r) for r in range(3)}
    for ly in cache.layers:  # a second event: the ring's older tokens quantised into new chunks
        quantise(ly, torch.tensor([0, 1]), torch.tensor([cache.widths[0], cache.widths[1]]), torch.tensor([110, 112]))
    for r in range(3):
        now = _by_position(cache, r)
        assert set(now) == set(mid[r])
        for key, (k, v) in now.items():  # quantised once: within a step of the old value, or unchanged
            assert torch.equal(k, mid[r][key][0]) or key[2] < 112
    snap = {r: _by_position(cache, r) for r in range(3)}
    cache._grow(2 * cache.layers[0].capacity)
    taken = cache.take_rows([2, 0])
    _same_tokens(snap[2], _by_position(taken, 0))
    assert set(_by_position(taken, 1)) == set(snap[0])
    other = RetentionCache.empty_like(cache, 2, cache.layers[0].capacity, static=True)
    other.load_row(1, cache, 1)
    assert set(_by_position(other, 1)) == set(snap[1])
    _same_tokens(snap[1], _by_position(other, 1))
    assert sum(row_bytes(ly, torch.tensor([1]), torch.tensor([other.widths[1]])) for ly in other.layers).item() == \
        _independent_bytes(cache, 1)
    cache.select_rows([1])
    _same_tokens(snap[1], _by_position(cache, 0))


def test_a_packed_cache_allocates_less_than_the_model_dtype_cache():
    """Qwen2.5-0.5B's shapes (2 KV heads, head dim 64) in bfloat16 at a 256-token capacity: the
    packed int8 and int4 caches allocate below the bfloat16 one, ring included: per (row, head) `cap`
    x (codes + value grids + a 4-byte slot) + `F` full-precision ring entries + key chunk grids."""
    S, G, d, cap = 4, 2, 64, 256
    plain = RetentionCache(1, capacity=cap)
    plain.set_step_positions(torch.arange(cap - 8).expand(S, -1))
    kv = torch.randn(S, G, cap - 8, d).to(torch.bfloat16)
    plain.update(kv, kv, 0)
    full = plain.allocated_bytes()
    assert full == S * G * cap * 2 * d * 2
    for bits, most in ((8, 0.84), (4, 0.6)):
        c = RetentionCache.empty_like(plain, S, cap)
        c.layers[0].pbuf.copy_(plain.layers[0].pbuf)
        c.layers[0].stores["k"].copy_(plain.layers[0].stores["k"])
        spec = PackSpec(bits, 16, "channel", 48, torch.bfloat16)
        to_packed(c.layers[0], spec, torch.full((S,), cap - 8), torch.full((S,), cap - 8 - 32))
        assert "k" not in c.layers[0].stores and c.allocated_bytes() < most * full, (bits, c.allocated_bytes(), full)
        per_token = 2 * d * bits // 8 + 2 * (d // 16) * 2 + 4  # codes, value grids, slot
        table = c.layers[0].packed.table.shape[2] * d * 2 * 2
        assert c.allocated_bytes() == S * G * (cap * per_token + 48 * 2 * d * 2 + table)


@pytest.mark.parametrize("bits,quantised,allocated", [(8, 7680, 0.828), (4, 4608, 0.578)])
def test_the_documented_bytes_per_token_of_qwen_shapes(bits, quantised, allocated):
    """docs/design-space.md's figures for Qwen2.5-0.5B (24 layers x 2 KV heads x 64, bf16; group 16,
    residual 32, capacity 256), from one layer's tensors: a quantised token's bytes (codes, grids and
    its share of a whole key chunk's grid) and a slot's allocation against the bf16 cache's."""
    S, G, d, cap, layers = 2, 2, 64, 256, 24
    plain = RetentionCache(1, capacity=cap)
    plain.set_step_positions(torch.arange(cap).expand(S, -1))
    kv = torch.randn(S, G, cap, d).to(torch.bfloat16)
    plain.update(kv, kv, 0)
    full_alloc, full_token = plain.allocated_bytes(), plain.layers[0].token_bytes()
    to_packed(plain.layers[0], PackSpec(bits, 16, "channel", 48, torch.bfloat16), torch.full((S,), cap),
              torch.full((S,), cap - 32))
    held = int(row_bytes(plain.layers[0], torch.tensor([0]), torch.tensor([cap]))[0])
    assert full_token * layers == 12288
    assert (held - 32 * full_token) / (cap - 32) * layers == quantised
    assert round(plain.allocated_bytes() / full_alloc, 3) == allocated
