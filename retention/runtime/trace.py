"""Cache traces: what a sequence's cache held, compaction by compaction (`--trace`).

The policy holds a tracer (`RetentionPolicy.tracer`). The base class `NullTracer` is the default:
every hook is a no-op, so an untraced run computes and stores nothing more than before. `CacheTracer`
records, per engine slot, what the schema of `docs/records.md` ("Cache traces", version
`TRACE_VERSION`) describes: at each compaction the absolute positions kept per eviction group and KV
head (packed bitsets), which kept positions a state stores otherwise (merged, quantised), a routing's
allocation when it makes one; at the end the prompt length, the per-step KL and top-1 agreement when
fidelity is on.

Hooks (shapes: due rows `B`, cache groups `Lc` = the cache's `RetentionLayer`s, KV heads `H`, kept `k`):

    begin(slot)                           the slot starts a sequence (`RetentionPolicy.reset_slot`)
    prefilled(cache)                      after a prefill forward, before its compaction (the policy)
    compacted(cache, rows, keep, view, policy)   after the gather and the state's after_compaction
    finish(slot, output_tokens, steps, fidelity) -> CacheTrace | None   the engine ends the sequence

Positions are mapped from the scorer's `keep` (indices into the view's slots, `[B, H, k]` for every
group or `[Lc, B, H, k]`) through each group's `view.positions`, so they are the absolute positions
of the tokens the cache kept. A compaction whose groups all kept the same positions (and states)
is stored once (`groups` = 1: shared routing); a sequence with one compaction that differs per
group stores every compaction per group (`groups` = `Lc`).

The size: one bitset of `ceil(n_positions / 8)` bytes (base64: 4/3 of that) per compaction, group and
head, times the state fields present, plus about 5 characters per step for the KL (rounded to
`KL_DIGITS` significant digits: a figure for the eye; the record's `fidelity` keeps exact means).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np
import torch

from retention.errors import RetentionError

TRACE_VERSION = 1
KL_DIGITS = 3
STATE_FIELDS = ("merged", "quantised")  # what `State.kept_state` may report, as the trace names it


def pack_positions(bits: np.ndarray) -> str:
    """base64 of a bool vector `[n]` packed little-endian (bit i of the bytes = position i)."""
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


def unpack_positions(text: str, n: int) -> np.ndarray:
    """The bool vector `[n]` of `pack_positions` (trailing bytes beyond `n` bits are padding)."""
    raw = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    return np.unpackbits(raw, count=n, bitorder="little").astype(bool)


def _grid(rows: tuple[tuple[str, ...], ...], n: int) -> np.ndarray:
    """`[G, H, n]` bool of a `[G][H]` grid of packed bitsets."""
    return np.stack([np.stack([unpack_positions(t, n) for t in heads]) for heads in rows])


@dataclass(frozen=True)
class Compaction:
    """One compaction of one sequence (schema fields of the same names; `[G][H]` grids)."""

    step: int                                   # output tokens generated when it happened (0: at prefill)
    before: int                                 # stored tokens per (layer, head) before it
    kept: tuple[tuple[int, ...], ...]           # tokens kept per group and head
    positions: tuple[tuple[str, ...], ...]      # packed bitsets of the kept absolute positions
    merged: tuple[tuple[str, ...], ...] | None = None
    quantised: tuple[tuple[str, ...], ...] | None = None
    allocation: tuple[tuple[int, ...], ...] | None = None

    def to_json(self) -> dict:
        out = {"step": self.step, "before": self.before, "kept": [list(h) for h in self.kept],
               "positions": [list(h) for h in self.positions]}
        for name in (*STATE_FIELDS, "allocation"):
            value = getattr(self, name)
            if value is not None:
                out[name] = [list(h) for h in value]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Compaction:
        grid = lambda v: None if v is None else tuple(tuple(h) for h in v)  # noqa: E731
        return cls(int(obj["step"]), int(obj["before"]), grid(obj["kept"]), grid(obj["positions"]),
                   grid(obj.get("merged")), grid(obj.get("quantised")), grid(obj.get("allocation")))


@dataclass(frozen=True)
class CacheTrace:
    """What one sequence's cache held (the `cache` object of a trace line, docs/records.md)."""

    prompt_tokens: int
    n_positions: int
    kv_heads: int
    groups: int
    layers: int
    prefill_stored: int
    compactions: tuple[Compaction, ...]
    steps: int
    kl: tuple[float, ...] | None = None
    top1: str | None = None
    version: int = TRACE_VERSION

    def to_json(self) -> dict:
        out = {"version": self.version, "prompt_tokens": self.prompt_tokens, "n_positions": self.n_positions,
               "kv_heads": self.kv_heads, "groups": self.groups, "layers": self.layers,
               "prefill_stored": self.prefill_stored, "compactions": [c.to_json() for c in self.compactions],
               "steps": self.steps}
        if self.kl is not None:
            out["kl"], out["top1"] = list(self.kl), self.top1
        return out

    @classmethod
    def from_json(cls, obj: dict) -> CacheTrace:
        if obj.get("version") != TRACE_VERSION:
            raise RetentionError(f"cache trace version {obj.get('version')!r}; this code reads version {TRACE_VERSION}")
        return cls(int(obj["prompt_tokens"]), int(obj["n_positions"]), int(obj["kv_heads"]), int(obj["groups"]),
                   int(obj["layers"]), int(obj["prefill_stored"]),
                   tuple(Compaction.from_json(c) for c in obj["compactions"]), int(obj["steps"]),
                   None if obj.get("kl") is None else tuple(float(x) for x in obj["kl"]), obj.get("top1"))

    def kept(self, i: int) -> np.ndarray:
        """`[G, H, n_positions]` bool: the positions compaction `i` kept."""
        return _grid(self.compactions[i].positions, self.n_positions)

    @property
    def prompt_evicted_step(self) -> int | None:
        """Output tokens generated when a prompt position was first evicted from any (group, head)
        (None: never)."""
        P = self.prompt_tokens
        for i, c in enumerate(self.compactions):
            if not self.kept(i)[:, :, :P].all():
                return c.step
        return None

    @property
    def prompt_held_final(self) -> float | None:
        """Share of the prompt positions held at the end, averaged over groups and heads (None: the
        sequence never compacted). Between compactions only generated positions are added, so the
        last kept set decides."""
        if not self.compactions or not self.prompt_tokens:
            return None
        return float(self.kept(len(self.compactions) - 1)[:, :, :self.prompt_tokens].mean())


@dataclass
class _Event:
    """A compaction of one sequence as recorded (packed over the positions that existed then)."""

    step: int
    before: int
    kept: np.ndarray                 # [g, H] int
    positions: np.ndarray            # [g, H, bytes] uint8 (g = 1 or Lc)
    states: dict[str, np.ndarray]    # name -> [g, H, bytes] uint8
    allocation: np.ndarray | None    # [g, H] int


@dataclass
class _Sequence:
    prompt_tokens: int
    prefill_stored: int
    kv_heads: int
    cache_groups: int
    layers: int
    events: list[_Event] = field(default_factory=list)


class NullTracer:
    """The default tracer: records nothing (every hook a no-op; `finish` returns None)."""

    def reset(self) -> None:
        """A run starts."""

    def begin(self, slot: int) -> None:
        """Engine slot `slot` starts a new sequence."""

    def prefilled(self, cache) -> None:
        """After a prefill forward of `cache` (each row one sequence, before any compaction)."""

    def compacted(self, cache, rows: list[int], keep: torch.Tensor, view, policy) -> None:
        """After the compaction of `rows` that kept `keep` (the scorer's indices into `view`'s slots)."""

    def finish(self, slot: int, output_tokens: int, steps: int, fidelity=None) -> CacheTrace | None:
        """The sequence of `slot` ended with `output_tokens` generated in `steps` decode steps."""
        return None


class CacheTracer(NullTracer):
    """Records a `CacheTrace` per sequence (module docstring)."""

    def __init__(self):
        self._open: dict[int, _Sequence] = {}

    def reset(self) -> None:
        self._open.clear()

    def begin(self, slot: int) -> None:
        self._open.pop(slot, None)

    def prefilled(self, cache) -> None:
        layers = cache.layout.layers if cache.is_layout else len(cache.layers)
        heads = cache.layers[0].pbuf.shape[1]
        for r, slot in enumerate(cache.slots):
            self._open[slot] = _Sequence(cache.prompt_lengths[r], cache.lengths[r], heads, len(cache.layers), layers)

    def compacted(self, cache, rows, keep, view, policy) -> None:
        kp = keep[None].expand(len(view.positions), *keep.shape) if keep.dim() == 3 else keep  # [Lc, B, H, k]
        # An allocating routing (PyramidKV, AdaKV) pads each head's kept indices with -1 after its count.
        held = kp >= 0
        pos = torch.stack([torch.gather(p, 2, kp[i].clamp(min=0).to(p.device)) for i, p in enumerate(view.positions)])
        pos = pos.masked_fill(~held.to(pos.device), -1)
        states = {name: torch.stack(masks) for name, masks in policy.state.kept_state(cache, rows).items()}
        alloc = held.sum(-1) if not bool(held.all()) else None  # [Lc, B, H]: the routing's counts
        before = torch.stack(view.valid).sum(-1).amax((0, 2)).tolist()  # [B]: the widest (layer, head) before it
        nxt = view.next_position.tolist()
        plen = view.prompt_length.tolist()
        slots = view.slots.tolist()
        pos = pos.cpu().numpy()
        states = {k: v.cpu().numpy() for k, v in states.items()}
        alloc = None if alloc is None else alloc.cpu().numpy()  # [Lc, B, H]
        for b, slot in enumerate(slots):
            p = pos[:, b]  # [Lc, H, k]
            s = {k: v[:, b] for k, v in states.items()}
            a = None if alloc is None else alloc[:, b]
            same = [p, *s.values(), *([] if a is None else [a])]
            if all((x == x[:1]).all() for x in same):  # every group alike: stored once
                p, s, a = p[:1], {k: v[:1] for k, v in s.items()}, None if a is None else a[:1]
            n_now = int(nxt[b])  # positions 0..n_now-1 exist now
            bits = np.zeros((*p.shape[:2], n_now + 1), dtype=bool)  # the extra column takes the -1 padding
            np.put_along_axis(bits, p, True, axis=-1)
            bits = bits[..., :n_now]
            packed = {}
            for name, mask in s.items():
                m = np.zeros((*p.shape[:2], n_now + 1), dtype=bool)
                np.put_along_axis(m, p, mask, axis=-1)
                m = m[..., :n_now]
                packed[name] = np.packbits(m, axis=-1, bitorder="little")
            self._open[slot].events.append(_Event(n_now - int(plen[b]), int(before[b]), bits.sum(-1),
                                                  np.packbits(bits, axis=-1, bitorder="little"), packed, a))

    def finish(self, slot, output_tokens, steps, fidelity=None) -> CacheTrace:
        seq = self._open.pop(slot)
        n = seq.prompt_tokens + output_tokens
        width = (n + 7) // 8
        groups = seq.cache_groups if any(e.positions.shape[0] > 1 for e in seq.events) else 1

        def grid(x: np.ndarray) -> tuple[tuple[str, ...], ...]:
            x = np.broadcast_to(x, (groups, *x.shape[1:]))
            x = np.pad(x, ((0, 0), (0, 0), (0, width - x.shape[-1])))
            return tuple(tuple(base64.b64encode(h.tobytes()).decode("ascii") for h in g) for g in x)

        def ints(x: np.ndarray | None) -> tuple[tuple[int, ...], ...] | None:
            if x is None:
                return None
            return tuple(tuple(int(v) for v in g) for g in np.broadcast_to(x, (groups, x.shape[1])))

        comps = tuple(Compaction(e.step, e.before, ints(e.kept), grid(e.positions),
                                 *(grid(e.states[f]) if f in e.states else None for f in STATE_FIELDS),
                                 ints(e.allocation)) for e in seq.events)
        kl = top1 = None
        if fidelity is not None:
            kl = tuple(float(f"{x:.{KL_DIGITS}g}") for x in fidelity.kl)
            top1 = "".join("1" if a else "0" for a in fidelity.top1_agree)
        return CacheTrace(seq.prompt_tokens, n, seq.kv_heads, groups, seq.layers, seq.prefill_stored, comps, steps,
                          kl, top1)
