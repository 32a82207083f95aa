"""Instruments for the contract kit: a scorer probe that checks every compaction, a policy that checks
physical eviction after every forward, and a host-read counter.

The probe wraps a scorer without changing what it does: the policy calls the probe's `score` and
`select`, which call the scorer's and then check what came back (shape, dtype, kept count, protected
tokens, padding) and note each row's kept positions under the seed of the sequence it belongs to
(the engine announces it through `reset_slot`), so kept sets compare across batch sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from retention.errors import RetentionError
from retention.runtime import syncs
from retention.policy.guard import figure_refusal, logits_refusal, outgrown, stored_kib_floor
from retention.policy.composite import RetentionPolicy

MAX_NOTES = 3  # violations quoted per check


class Probe:
    """A scorer seen through the contract's checks (every other attribute is the scorer's own)."""

    def __init__(self, scorer, checks: bool = True):
        self.inner = scorer
        self.checks = checks
        self.slot_seed: dict[int, int] = {}
        self.kept: dict[int, list] = defaultdict(list)  # seed -> kept positions per compaction
        # slot -> kept positions `[L, G, k]` of its last compaction (-1 at an allocation's holes)
        self.last_kept: dict[int, torch.Tensor] = {}
        self.allocations = 0  # compactions with different counts per (layer, KV head)
        self.count_range = (None, None)  # the smallest and largest count an allocation gave a head
        self.violations: dict[str, list[str]] = defaultdict(list)
        self.calls = 0  # after_forward calls (observe is called once per forward)
        self.view_rows: list[int] = []  # rows of each compaction view
        self.padded: list[bool] = []  # whether that view held padding
        self.due_calls: set[int] = set()  # forward calls at which some row compacted
        self.phase: str | None = None  # which scorer hook is running (for the host-read counter)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _note(self, check: str, text: str) -> None:
        self.violations[check].append(text)

    @contextlib.contextmanager
    def _in(self, phase: str):
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def reset_slot(self, slot: int, seed: int) -> None:
        self.slot_seed[slot] = seed
        with self._in("setup"):
            self.inner.reset_slot(slot, seed)

    def reset(self) -> None:
        with self._in("setup"):
            self.inner.reset()

    @contextlib.contextmanager
    def attach(self, model):
        with self._in("setup"):
            cm = self.inner.attach(model)
            value = cm.__enter__()
        try:
            yield value
        except BaseException as exc:
            with self._in("setup"):
                if not cm.__exit__(type(exc), exc, exc.__traceback__):
                    raise
        else:
            with self._in("setup"):
                cm.__exit__(None, None, None)

    def observe(self, cache, next_position) -> None:
        self.calls += 1
        self.phase = "observe"
        try:
            self.inner.observe(cache, next_position)
        finally:
            self.phase = None

    def compacted(self, keep, view) -> None:
        self.phase = "compaction"
        try:
            self.inner.compacted(keep, view)
        finally:
            self.phase = None

    def score(self, view):
        self.phase = "compaction"
        before = _view_tensors(view) if self.checks else None
        try:
            scores = self.inner.score(view)
        finally:
            self.phase = None
        if self.checks:
            self._check_unchanged(before, view, "score")
            L, (B, G, n) = len(view.keys), view.keys[0].shape[:3]
            want = (L, B, G, n) if self.inner.per_layer else (B, G, n)
            if not isinstance(scores, torch.Tensor):
                self._note("score shape and dtype", f"score returned {type(scores).__name__}, not a tensor")
            elif tuple(scores.shape) != want or not scores.dtype.is_floating_point:
                self._note("score shape and dtype", f"score is {tuple(scores.shape)} {scores.dtype}, expected "
                                                    f"{want} floating point")
            elif bool(torch.isnan(scores).any()):
                self._note("score shape and dtype", "score holds NaN")
        return scores

    def select(self, scores, view, k: int):
        self.phase = "compaction"
        before = _view_tensors(view) if self.checks else None
        try:
            keep = self.inner.select(scores, view, k)
        finally:
            self.phase = None
        if self.checks:
            self._check_unchanged(before, view, "select")
            self._check_keep(keep, view, k)
        return keep

    def allocated(self, keep: torch.Tensor, allocation, view, k: int) -> None:
        """Check an allocating routing's compaction: `keep` `[L, B, G, m]`, each head's kept indices
        ascending then -1; every row's counts sum to `L x G x k` (the uniform mean); protected
        kept, padding never; and note the kept positions per seed, head by head."""
        L, (B, G, n) = len(view.keys), view.keys[0].shape[:3]
        self.view_rows.append(B)
        self.padded.append(not bool(torch.stack(view.valid).all()))
        self.due_calls.add(self.calls)
        self.allocations += 1
        if keep.dim() != 4 or tuple(keep.shape[:3]) != (L, B, G):
            self._note("kept count", f"an allocation kept {tuple(keep.shape)}, expected [{L}, {B}, {G}, m]")
            return
        keep = keep.long()
        real = keep >= 0
        counts = real.sum(-1)  # [L, B, G]
        lo, hi = int(counts.min()), int(counts.max())
        self.count_range = (lo if self.count_range[0] is None else min(lo, self.count_range[0]),
                            hi if self.count_range[1] is None else max(hi, self.count_range[1]))
        first = torch.arange(keep.shape[-1], device=keep.device) < counts[..., None]
        steps = keep.diff(dim=-1)
        if not torch.equal(real, first) or bool((keep >= n).any()) or bool(((steps <= 0) & first[..., 1:]).any()):
            self._note("kept count", "an allocation's kept indices are not ascending distinct indices then -1")
            return
        sums = counts.sum((0, 2)).tolist()
        if any(t != L * G * k for t in sums):
            self._note("kept count", f"an allocation kept {sums} tokens per row, not L x G x k = {L * G * k}")
        if [int(w) for w in counts.amax((0, 2)).tolist()] != list(allocation.widths) or allocation.mean != k:
            self._note("kept count", f"the allocation reports widths {allocation.widths} and mean {allocation.mean}, "
                                     f"its indices say {counts.amax((0, 2)).tolist()} and {k}")
        kept = torch.zeros(L, B, G, n + 1, dtype=torch.bool, device=keep.device).scatter_(
            -1, torch.where(real, keep, n), True)[..., :n]
        protected, valid = torch.stack(view.protected), torch.stack(view.valid)
        if bool((protected & ~kept).any()):
            self._note("protected tokens kept", f"{int((protected & ~kept).sum())} protected token(s) evicted "
                                                f"at an allocation over {B} row(s)")
        if bool((kept & ~valid).any()):
            self._note("padding never kept", f"{int((kept & ~valid).sum())} padding entr(ies) kept at an "
                                             f"allocation over {B} row(s)")
        positions = torch.stack(view.positions).gather(-1, keep.clamp(min=0)).masked_fill(~real, -1)
        slots = view.slots.tolist()
        for b, slot in enumerate(slots):
            width = allocation.widths[b]
            held = positions[:, b, :, :width]  # [L, G, width]
            self.kept[self.slot_seed.get(slot, -1)].append([[[p for p in head if p >= 0] for head in layer]
                                                            for layer in held.tolist()])
            self.last_kept[slot] = held

    def _check_unchanged(self, before: dict[str, torch.Tensor], view, hook: str) -> None:
        """Name each tensor of the view that `hook` wrote into (a view is read-only: `CacheView`)."""
        after = _view_tensors(view)
        changed = [name for name, t in before.items() if name not in after or not torch.equal(t, after[name])]
        if changed:
            self._note("view unchanged", f"{hook} wrote into its view: {', '.join(changed[:4])}"
                                         + (f" and {len(changed) - 4} more" if len(changed) > 4 else ""))

    def _check_keep(self, keep, view, k: int) -> None:
        L, (B, G, n) = len(view.keys), view.keys[0].shape[:3]
        self.view_rows.append(B)
        self.padded.append(not bool(torch.stack(view.valid).all()))
        self.due_calls.add(self.calls)
        head = (L, B, G) if self.inner.per_layer else (B, G)
        if tuple(keep.shape) != (*head, k):
            self._note("kept count", f"kept {tuple(keep.shape)} at a compaction to k = {k} (expected {(*head, k)})")
            return
        keep = keep.long()
        if bool((keep < 0).any() | (keep >= n).any()) or bool((keep.diff(dim=-1) <= 0).any()):
            self._note("kept count", f"kept indices are not {k} distinct ascending indices in [0, {n})")
            return
        full = keep if keep.dim() == 4 else keep.expand(L, B, G, k)  # [L, B, G, k]
        kept = torch.zeros(L, B, G, n, dtype=torch.bool, device=keep.device).scatter_(-1, full, True)
        protected, valid = torch.stack(view.protected), torch.stack(view.valid)
        if bool((protected & ~kept).any()):
            self._note("protected tokens kept", f"{int((protected & ~kept).sum())} protected token(s) evicted "
                                                f"at a compaction of {B} row(s)")
        if bool((kept & ~valid).any()):
            self._note("padding never kept", f"{int((kept & ~valid).sum())} padding entr(ies) kept at a compaction "
                                             f"of {B} row(s)")
        positions = torch.stack(view.positions).gather(-1, full)  # [L, B, G, k]
        slots = view.slots.tolist() if isinstance(view.slots, torch.Tensor) else list(view.slots)
        for b, slot in enumerate(slots):
            self.kept[self.slot_seed.get(slot, -1)].append(positions[:, b].tolist())
            self.last_kept[slot] = positions[:, b]


class Phased:
    """A mechanism (state, routing, decoding) whose calls run in the probe's `compaction` phase: its
    host reads at compactions are reported with the scorer's, not counted as the engine's."""

    def __init__(self, inner, probe: Probe):
        self.inner, self.probe = inner, probe

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self.probe._in("compaction"):
                return attr(*args, **kwargs)
        return call


class CheckedDecoding:
    """A decoding whose every output is checked against the logits it was given (`logits_refusal`);
    a broken output is noted and replaced by the logits given, so the decode goes on to the other checks."""

    def __init__(self, inner):
        self.inner = getattr(inner, "inner", inner)  # never the run's own guard: the kit names the check
        self.violations: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def adjust(self, logits, rows, histories):
        out = self.inner.adjust(logits, rows, histories)
        refusal = logits_refusal(self.inner.name, logits, out)
        if refusal is None:
            return out
        if len(self.violations) < MAX_NOTES:
            self.violations.append(refusal)
        return logits


@dataclass
class CheckedPolicy(RetentionPolicy):
    """A policy that checks physical eviction after every forward: each row stores exactly what its
    meter counts (and what it kept: the positions in the buffers after a compaction are the kept
    ones), and the bytes stored are the bytes of that many tokens; that the routing's keep holds the
    cadence's `k` per head; that the metered KiB are finite and not below what the buffers can be
    stored in (`retention.policy.guard.stored_kib_floor`: believes nothing the state says); and that
    no row outgrows `b + span` (a cadence that lets it is refused in one line naming it)."""

    violations: list[str] = field(default_factory=list)
    byte_violations: list[str] = field(default_factory=list)

    def select(self, view, k: int):
        keep, allocation = super().select(view, k)
        if allocation is not None:
            self.scorer.allocated(keep, allocation, view, k)
        elif isinstance(keep, torch.Tensor) and keep.shape[-1] != k:  # what the cache will hold, not what the scorer said
            self.scorer._note("kept count", f"the routing kept {keep.shape[-1]} tokens per head at a compaction to "
                                            f"k = {k}")
        return keep, allocation

    def after_forward(self, cache, next_position, meter, prefill: bool, tokens=None) -> bool:
        probe = self.scorer
        before = dict(probe.last_kept)
        did = super().after_forward(cache, next_position, meter, prefill, tokens)
        c = self.cadence
        refusal = outgrown(cache, c) if probe.evicts and not prefill else None
        if refusal is not None:
            raise RetentionError(f"mean budget held: {refusal}")
        packed = cache.layers[0].packed is not None
        if len(self.violations) >= MAX_NOTES or (cache.layers[0].kbuf is None and not packed):
            return did
        meters = [meter] if not isinstance(meter, list) else meter
        for r in range(cache.rows):
            m = meters[r] if r < len(meters) else meters[0]
            if m is None:  # a padding row of the static step: no sequence to check
                continue
            width = cache.widths[r]
            # Stored tokens per (layer, KV head), recounted from the positions (-1: hole or free).
            heads = torch.stack([(ly.pbuf[r, :, :width] >= 0).sum(-1) for ly in cache.layers])  # [L, G]
            stored = heads.float().mean(-1).tolist()
            mean = float(heads.double().mean())
            if (mean != m.final or cache.lengths[r] != m.final
                    or (not cache.holes[r] and bool((heads != m.final).any()))):
                self.violations.append(f"row stores {stored} tokens per layer (mean over heads), the meter "
                                       f"counts {m.final}")
            slot = cache.slots[r]
            now = probe.last_kept.get(slot)
            if did and now is not None and before.get(slot) is not now:  # this row compacted just now
                k = now.shape[-1]
                held = torch.stack([ly.pbuf[r, :, :k] for ly in cache.layers])  # [L, G, k]
                if k != cache.widths[r] or not torch.equal(held, now.to(held.device)):
                    self.violations.append(f"after a compaction the buffers hold other positions than the {k} kept")
        if packed:  # the bytes its tensors hold (`packed_kv.row_bytes`) fit in what is allocated
            if cache.stored_bytes() > cache.allocated_bytes():
                self.violations.append(f"stored bytes {cache.stored_bytes()} exceed the {cache.allocated_bytes()} "
                                       "allocated")
        else:
            per_token = sum(2 * ly.kbuf[0, :, 0].numel() * ly.kbuf.element_size() for ly in cache.layers)
            if cache.stored_bytes() != per_token * sum(cache.lengths) or cache.stored_bytes() > cache.allocated_bytes():
                self.violations.append(f"stored bytes {cache.stored_bytes()} are not {sum(cache.lengths)} tokens' worth")
        for r in range(cache.rows):  # the state's meter figure equals its recount from the buffers
            m = meters[r] if r < len(meters) else meters[0]
            if m is None:
                continue
            kpt = m.kib_per_token
            with probe._in("compaction"):
                metered = self.state.row_kib(cache, r, kpt)
                recount = self.state.stored_kib(cache, r, kpt)
            metered = cache.lengths[r] * kpt if metered is None else metered
            bad = figure_refusal(f"the meter's KiB of a row ({self.state.name} state)", metered)
            floor = stored_kib_floor(cache, r, self.state, kpt)
            if bad is None and metered < floor * (1 - 1e-9):
                bad = (f"the meter counts {metered:.6g} KiB in a row whose buffers need at least {floor:.6g} KiB "
                       f"({self.state.name} state; recounted from the stored values)")
            if bad is not None and len(self.byte_violations) < MAX_NOTES:
                self.byte_violations.append(bad)
            if abs(metered - recount) > 1e-9 * max(1.0, recount):  # the state's own recount, as before
                self.violations.append(f"the meter counts {metered:.6g} KiB in a row whose buffers hold "
                                       f"{recount:.6g} KiB ({self.state.name} state)")
                break
        return did


def _view_tensors(view) -> dict[str, torch.Tensor]:
    """Copies of every tensor a `CacheView` holds, by name (`keys[0]`, `stores[1].k`, `next_position`)."""
    out = {}
    for f in dataclasses.fields(view):
        value = getattr(view, f.name)
        items = [("", value)] if not isinstance(value, list) else [(f"[{i}]", v) for i, v in enumerate(value)]
        for suffix, item in items:
            if isinstance(item, torch.Tensor):
                out[f"{f.name}{suffix}"] = item.clone()
            elif isinstance(item, dict):
                out.update({f"{f.name}{suffix}.{k}": v.clone() for k, v in item.items() if isinstance(v, torch.Tensor)})
    return out


@contextlib.contextmanager
def count_host_reads(probe: Probe):
    """Count host reads (`retention.runtime.syncs.HOST_READS`) while active: {"observe": n,
    "compaction": n, "setup": n, "engine": n} by which scorer hook (if any) was running ("setup":
    attach, reset, reset_slot)."""
    with syncs.count_host_reads(lambda: probe.phase or "engine") as counts:
        counts.update({"observe": 0, "compaction": 0, "setup": 0, "engine": 0})
        yield counts
