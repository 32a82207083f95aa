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
  `retention check`). `store="packed"` (new runs): the cache holds the codes and float16 grids
  (`retention.runtime.packed_kv`) and the attention dequantises them a chunk at a time; the meter
  counts the bytes of those tensors. `store="simulated"` (configurations written before it): the
  quantised values are kept dequantised in the model's dtype in the cache's buffers and the meter
  counts the bytes a packed store holds. Either way, in the meter's unit (`kib_per_token` per
  full-precision token): `bits / 8` bytes per code, a 2-byte scale and zero point per key chunk
  and channel and per value group. So a quantised arm at `--budget-bytes` holds more tokens than
  `full` at the same bytes, and at `--budget` (tokens) it stores fewer bytes.

Plugins subclass `State` (entry-point group `retention.states`, `module:Class`, `file.py:Class`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.settings import TrivialSetting

SCALE_BYTES = 2  # a scale or zero point is stored as a 16-bit float


@dataclass
class State(TrivialSetting):
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

    def attach(self, model) -> contextlib.AbstractContextManager:
        """The context the run's forwards run in (the packed `quant` store's attention); none here."""
        return contextlib.nullcontext()

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


    def tokens_for_kib(self, kib: float, kib_per_token: float, head_dims, layers: int, heads: int, span: int) -> int:
        """The token budget `B` whose measured mean stays within `kib` KiB per sequence under this
        state (`span`: the cadence's tokens above `b`); full precision: `kib / kib_per_token`."""
        return int(kib // kib_per_token)


def kept_flags(cache, rows: list[int], name: str) -> list[torch.Tensor]:
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


def full_token_bytes(cache) -> int:
    """Bytes one full-precision token costs in every layer and KV head of the cache (K and V)."""
    return sum(layer.token_bytes() for layer in cache.layers)
