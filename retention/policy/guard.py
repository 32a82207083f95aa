"""Checks that believe nothing a mechanism says about itself: the bytes a row can be stored in,
recounted from the buffers, and the cheap invariants of a plugin's outputs at its first compactions.

Used by the contract kit after every forward (`retention.contract.probe.CheckedPolicy`) and, for an
arm with a plugin, by the run itself (`GuardedPolicy`, built by `ArmSpec.policy`): a plugin whose
scores, kept indices, stored bytes or adjusted logits break the contract is refused in one line at
its first compaction (`run`, `confirm`), before any record is written.

**The byte floor** (`stored_kib_floor`): the fewest KiB row `row`'s buffers can be held in. A token
whose values are stored dequantised counts as `bits`-bit codes only where the values show it: each
group of `group` channels of a token's value vector (the state's own `bits` and `group`) holds at
most `2 ** bits` distinct values on a uniform min-max grid (checked where the buffer's dtype
resolves the grid: float32/float64; in half precision the distinct-value count alone). Keys are
counted at `bits` optimistically (their chunks run along tokens), scales and zero points not at all:
a floor, which an honest meter is never below. A state without `bits` stores full precision. A
packed store (`RetentionLayer.packed`, `retention.runtime.packed_kv`) is floored from its tensors
alone: every stored token costs at least one entry of its code tensors (`qk`, `qv`: their `nbytes`),
whatever the state says of its scales or of which tokens are quantised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from retention.errors import RetentionError
from retention.policy.composite import RetentionPolicy

# Plugin compactions checked before the guard steps aside (the checks read the device).
GUARDED_COMPACTIONS = 2
GUARDED_STEPS = 4


class GuardRefusal(RetentionError):
    """A plugin refused by `GuardedPolicy` (its line names the plugin and what it did)."""


def _grid_ok(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Whether each group (last dim) of `v` `[..., group]` could be `bits`-bit min-max codes: at most
    `2 ** bits` distinct values and, where the dtype resolves it, on a uniform grid. Returns `[...]` bool."""
    levels = 2 ** bits
    srt = v.sort(-1).values
    distinct = 1 + (srt.diff(dim=-1) != 0).sum(-1)  # [...]
    ok = distinct <= levels
    eps = torch.finfo(v.dtype).eps if v.dtype.is_floating_point else 0.0
    if (levels - 1) * eps * 8 < 0.25:  # the grid is resolvable in this dtype
        x = v.double()
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        step = ((hi - lo) / (levels - 1)).clamp(min=1e-300)
        r = (x - lo) / step
        ok &= ((r - r.round()).abs().amax(-1) <= 1e-3) | (hi - lo).squeeze(-1).eq(0)
    return ok


def stored_kib_floor(cache, row: int, state, kib_per_token: float) -> float:
    """The fewest KiB row `row` can be stored in (module docstring), from the buffers alone."""
    full = cache.lengths[row] * kib_per_token
    bits, group = getattr(state, "bits", None), getattr(state, "group", None)
    layer0 = cache.layers[0]
    if layer0.packed is not None:  # codes in the cache: a token costs at least its code entries
        codes = sum(ly.stores["qk"][0, :, 0].nbytes + ly.stores["qv"][0, :, 0].nbytes for ly in cache.layers)
        full_bytes = sum(ly.token_bytes() for ly in cache.layers)
        return full * codes / full_bytes
    if not isinstance(bits, int) or not isinstance(group, int) or group < 1 or layer0.vbuf is None:
        return full
    width = cache.widths[row]
    total = 0.0  # in units of one (layer, head) token in full precision, summed over layers and heads
    heads = 0
    for ly in cache.layers:
        v, valid = ly.vbuf[row, :, :width], ly.pbuf[row, :, :width] >= 0  # [G, w, d], [G, w]
        G, w, d = v.shape
        heads += G
        q = min(1.0, bits / (8 * v.element_size()))
        if d % group:
            total += float(valid.sum())
            continue
        coded = _grid_ok(v.reshape(G, w, d // group, group), bits).all(-1)  # [G, w]: the token's values are codes
        total += float((valid * (0.5 * q + torch.where(coded, 0.5 * q, 0.5))).sum())
    if heads == 0:
        return full
    # `lengths` is the mean stored tokens per (layer, head): the floor in those units, scaled to KiB.
    return total / heads * kib_per_token


def outgrown(cache, cadence) -> str | None:
    """A line when a row, after a forward and its compactions, stores `b + span` tokens or more: the
    next forward would write past what the cadence promised (and past the buffers sized for it)."""
    for r in range(cache.rows):
        limit = cadence.keep(cache.prompt_lengths[r]) + cadence.span
        if cache.lengths[r] >= limit:
            return (f"a row stores {cache.lengths[r]} tokens after a forward, and b + span = {limit} is the most "
                    f"it may reach: cadence {cadence.name!r} let it outgrow its buffers (it was never due)")
    return None


def figure_refusal(what: str, value) -> str | None:
    """A line when a figure a mechanism reports is not a finite number, else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return f"{what} is {value!r}, not a finite number"
    return None


def logits_refusal(name: str, before: torch.Tensor, after) -> str | None:
    """A line when decoding `name`'s adjusted logits break the contract: another shape or dtype (a
    token that can never be drawn), NaN or +inf, or a row with nothing left to draw."""
    if not isinstance(after, torch.Tensor):
        return f"decoding {name!r} returned {type(after).__name__}, not the logits"
    if after.shape != before.shape or after.dtype != before.dtype:
        return (f"decoding {name!r} returned logits {tuple(after.shape)} {after.dtype}, not the "
                f"{tuple(before.shape)} {before.dtype} it was given")
    if bool(torch.isnan(after).any() | torch.isposinf(after).any()):
        return f"decoding {name!r} returned NaN or +inf logits"
    if after.numel() and bool(torch.isneginf(after).all(-1).any()):
        return f"decoding {name!r} banned every token of a row"
    return None


class _GuardedDecoding:
    """A decoding whose first `GUARDED_STEPS` outputs are checked (`logits_refusal`)."""

    def __init__(self, inner):
        self.inner, self.left = inner, GUARDED_STEPS

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def adjust(self, logits, rows, histories):
        out = self.inner.adjust(logits, rows, histories)
        if self.left > 0:
            self.left -= 1
            refusal = logits_refusal(self.inner.name, logits, out)
            if refusal is not None:
                raise GuardRefusal(refusal)
        return out


@dataclass
class GuardedPolicy(RetentionPolicy):
    """A policy whose plugins are checked at their first compactions (module docstring): scores
    (shape, floating dtype, finite), kept indices (shape `[..., k]`, in range), each row's metered KiB
    (finite, not below `stored_kib_floor`), and the decoding's logits."""

    plugins: tuple[str, ...] = ()
    _left: int = field(default=GUARDED_COMPACTIONS, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        self.cadence_plugin = any(p.startswith("cadence:") for p in self.plugins)
        if any(p.startswith("decoding:") for p in self.plugins):
            self.decoding = _GuardedDecoding(self.decoding)

    def _refuse(self, what: str) -> None:
        raise GuardRefusal(f"{', '.join(self.plugins)}: {what} at its first compaction; "
                             "`retention check` names the failing check")

    def select(self, view, k: int):
        if self._left <= 0:
            return super().select(view, k)
        # positions, not keys: on a latent or shared-store layout `view.keys` is empty and each
        # eviction group's `positions` [B, G, n] is what the scores are shaped by
        L, (B, G, n) = len(view.positions), view.positions[0].shape[:3]
        scores = self.scorer.score(view)
        want = (L, B, G, n) if self.scorer.per_layer else (B, G, n)
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want or not scores.dtype.is_floating_point:
            got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            self._refuse(f"scores {got} {getattr(scores, 'dtype', '')}, expected {want} floating point")
        if bool(torch.isnan(scores).any()):
            self._refuse("scores hold NaN")
        keep, allocation = self.routing.keep(self.scorer, scores, view, k)
        if not isinstance(keep, torch.Tensor) or keep.dim() < 3:
            self._refuse(f"the kept indices are {type(keep).__name__} {tuple(getattr(keep, 'shape', ()))}")
        if allocation is None and (keep.shape[-1] != k or tuple(keep.shape[-3:-1]) != (B, G)):
            self._refuse(f"{tuple(keep.shape)} kept at a compaction to k = {k} (expected [..., {B}, {G}, {k}])")
        if bool(((keep >= n) | (keep < -1)).any()):
            self._refuse(f"kept indices outside [0, {n})")
        return keep, allocation

    def after_forward(self, cache, next_position, meter, prefill: bool, tokens=None) -> bool:
        if self._left <= 0 and not self.cadence_plugin:
            return super().after_forward(cache, next_position, meter, prefill, tokens)
        # (what a plugin raises goes on to the runner, which names it: `retention.runs.runner`)
        did = super().after_forward(cache, next_position, meter, prefill, tokens)
        if self.cadence_plugin and not prefill and self.scorer.evicts:  # host ints: cheap on every step
            grown = outgrown(cache, self.cadence)
            if grown is not None:
                raise GuardRefusal(f"{', '.join(self.plugins)}: {grown}")
        if did and self._left > 0 and cache.layers[0].pbuf is not None:
            self._left -= 1
            meters = meter if isinstance(meter, list) else [meter]
            for r in range(cache.rows):
                m = meters[r] if r < len(meters) else meters[0]
                if m is None:
                    continue
                kib = self.state.row_kib(cache, r, m.kib_per_token)
                kib = cache.lengths[r] * m.kib_per_token if kib is None else kib
                bad = figure_refusal(f"the KiB state {self.state.name!r} reports for a row", kib)
                if bad is None:
                    floor = stored_kib_floor(cache, r, self.state, m.kib_per_token)
                    if kib < floor * (1 - 1e-9):
                        bad = (f"state {self.state.name!r} reports {kib:.6g} KiB for a row whose buffers need at "
                               f"least {floor:.6g} KiB")
                if bad is not None:
                    self._refuse(bad)
        return did
