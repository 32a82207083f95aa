"""`snapkv`: SnapKV run at decode time, from the last `window` queries of every layer.

Shapes: layers `L`, batch `B`, KV heads `G`, query heads `Hq = G * r`, window `w`, stored tokens `n`,
head dim `d`.

The post-RoPE queries are recorded as the model computes them (`retention.runtime.capture`), and the last `w`
of each layer are kept: they are never recomputed with the current step's rotation. At a
compaction, per layer and KV head:

1. logits of the `w` window queries against the candidate keys (every stored token except the
   window's own `w`, i.e. the `w` newest positions), times the model's attention scale;
2. max over the group's `r` query heads, on the raw logits;
3. softmax over the candidates in float32, mean over the `w` window queries;
4. 1-D max-pool over the stored order (slot neighbours), kernel 7, stride 1, same size, over the
   candidates alone (window slots and padding never win);
5. top-`(b - w)` per (layer, KV head), plus the `w` window tokens (scored +inf: always kept).

Two rules, the parameter `rule` (docs/scorers.md):

* `head` (above; reads the queries and the per-head keys: transformers models): logits maxed over
  each KV head's query heads, softmax over the candidates.
* `group` (reads the attention a layout model's modules report: MLA latents, CLA and path groups):
  the probabilities each stored token received from the last `w` forwards, normalised over every
  stored token as the model attended, summed over the eviction group's layers and query heads,
  averaged over the recorded forwards (at most `w`), max-pooled among the candidates as in step 4.
  The window is per-token state of the cache (`[S, G, cap, w]`), so it follows every compaction.

The default (`rule` unset) is what the model provides: `group` on a layout model, `head` otherwise.
Reference defaults: `w = 8`, kernel 7, interval 128. The scorer asks the cadence to protect at least
the `w` newest tokens (`min_recent`), so the budget accounting counts the window inside `b`.
(The original SnapKV is prefill-only with window 32, kernel-5 average pooling, per query head.)
"""

from __future__ import annotations

from typing import ClassVar
import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from retention.runtime.cache import CacheView
from retention.errors import RetentionError
from retention.policy.scoring.base import WindowScorer


def group_max_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Step 1-2: window queries `[B, Hq, w, d]` against keys `[B, G, n, d]` -> `[B, G, w, n]` float32
    logits `q . k * scaling`, max over each KV head's `r = Hq / G` query heads (before any softmax)."""
    B, G, n, d = keys.shape
    Hq, w = queries.shape[1], queries.shape[2]
    q = queries.float().reshape(B, G, Hq // G, w, d)
    return torch.einsum("bgrwd,bgnd->bgrwn", q, keys.float()).amax(dim=2) * scaling


def window_attention_mean(logits: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Step 3: logits `[B, G, w, n]`, candidates `[B, G, n]` bool -> `[B, G, n]` float32: softmax over
    the candidates only (the window's own keys and padding are outside the normalisation), mean over
    the `w` queries; 0 at non-candidates (a row without candidates is all 0, not NaN)."""
    probs = torch.softmax(logits.float().masked_fill(~candidates[:, :, None, :], float("-inf")), dim=-1)
    return probs.nan_to_num_(0.0).mean(dim=2)


def pool_candidates(x: torch.Tensor, candidates: torch.Tensor, kernel: int) -> torch.Tensor:
    """Step 4: 1-D max-pool `[B, G, n]` over slot neighbours (kernel `kernel`, stride 1, same size).
    Non-candidates never contribute (they enter as -inf, like the reference's edge padding: the
    reference pools the candidate slice alone) and come out as 0."""
    B, G, n = x.shape
    xs = x.float().masked_fill(~candidates, float("-inf")).reshape(B * G, 1, n)
    pooled = F.max_pool1d(xs, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(B, G, n)
    return pooled.masked_fill(~candidates, 0.0)


def window_importance(queries: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scaling: float,
                      kernel: int) -> torch.Tensor:
    """SnapKV importance of one layer (steps 1-4 of the module doc).

    queries `[B, Hq, w, d]`, keys `[B, G, n, d]`, candidates `[B, G, n]` bool (not window, not
    padding) -> `[B, G, n]` float32, zero on non-candidates.
    """
    probs = window_attention_mean(group_max_logits(queries, keys, scaling), candidates)
    return pool_candidates(probs, candidates, kernel)


RULES = ("head", "group")


@dataclass
class SnapKV(WindowScorer):
    """Decode-time SnapKV. Parameters: `window` (recent queries and protected tokens, default 8),
    `kernel` (max-pool width, odd, default 7), `rule` (`head` or `group`, module doc; default: what
    the model provides)."""

    name: ClassVar[str] = "snapkv"

    EXTRA = "snapkv_window"
    reads = (frozenset({"queries", "keys"}), frozenset({"attention"}))
    # Parameters left out of a run's configuration while unset (configurations from before they existed).
    unrecorded_when_unset = ("rule",)
    kernel: int = 7
    rule: str | None = None
    _rule: str = field(default="head", init=False, repr=False)
    # Per layer: the last `w` recorded queries of every slot, `[slots, Hq, w, d]` (a rolling window,
    # newest last), and how many of them are real so far per slot (a prompt may be shorter than `w`).
    _queries: list = field(default_factory=list, init=False, repr=False)
    _count: dict = field(default_factory=dict, init=False, repr=False)  # slot -> recorded queries (<= w)
    _scaling: float = field(default=1.0, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.kernel <= 0 or self.kernel % 2 == 0:
            raise RetentionError(f"the pooling kernel must be a positive odd number, got {self.kernel}")
        if self.rule is not None and self.rule not in RULES:
            raise RetentionError(f"the snapkv rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        self._rule = self.rule or "head"

    def reading(self):
        return self.reads if self.rule is None else (self.reads[RULES.index(self.rule)],)

    def attach(self, model):
        """The `group` rule reads what the layout modules report; `head` records the queries."""
        self._rule = self.rule or ("group" if getattr(model, "reports_attention", False) else "head")
        if self._rule == "group":
            return contextlib.nullcontext(self)
        return self._attached(model)

    def reset(self) -> None:
        self._queries, self._count = [], {}

    def reset_slot(self, slot: int, seed: int) -> None:
        self._count[slot] = 0

    def observe(self, cache, next_position: list[int]) -> None:
        """Roll this forward's queries (`head`) or attention (`group`) of every row into its slot's
        window of the last `w`."""
        if self._rule == "group":
            self._observe_group(cache)
            return
        calls = self._recorder.take(cache)
        q_new = calls[0].query.shape[2]
        row_slots = getattr(cache, "slots", None) or list(range(calls[0].query.shape[0]))
        slots = torch.tensor(row_slots, device=calls[0].query.device)
        need = max(row_slots) + 1
        for i, call in enumerate(calls):
            q = call.query
            R, Hq, _, d = q.shape
            if len(self._queries) <= i:
                self._queries.append(q.new_zeros(need, Hq, self.window, d))
            buf = self._queries[i]
            if buf.shape[0] < need:
                buf = self._queries[i] = torch.cat([buf, buf.new_zeros(need - buf.shape[0], *buf.shape[1:])])
            if q_new >= self.window:
                buf[slots] = q[:, :, -self.window:]
            else:
                buf[slots] = torch.cat([buf[slots][:, :, q_new:], q], dim=2)
        for s in row_slots:
            self._count[s] = min(self.window, self._count.get(s, 0) + q_new)
        self._scaling = calls[0].scaling

    def _observe_group(self, cache) -> None:
        w = self.window
        for g, probs in enumerate(cache.attention):  # [R, G, q, n]
            win = cache.add_extra(g, self.EXTRA, (w,), dtype=probs.dtype)  # [S, G, cap, w], newest last
            n = probs.shape[-1]
            win[:, :, :n] = torch.cat([win[:, :, :n], probs[:, :, -w:].transpose(2, 3)], -1)[..., -w:]
        q = cache.attention[0].shape[2]
        for s in cache.slots:
            self._count[s] = min(w, self._count.get(s, 0) + min(q, w))

    def _group_importance(self, view: CacheView, g: int) -> torch.Tensor:
        """`[B, G, n]` pooled window probabilities of group `g` (the `group` rule), 0 off the candidates."""
        w = self.window
        win = view.extra[g][self.EXTRA].permute(0, 3, 1, 2).contiguous()  # [B, w, G, n]
        count = torch.tensor([self._count.get(s, w) for s in view.slots.tolist()], device=win.device)
        recorded = torch.arange(w, device=win.device)[None] >= w - count[:, None]  # [B, w]
        mean = (win * recorded[:, :, None, None]).sum(1) / count[:, None, None]
        cand = view.valid[g] & ~self.window_mask(view, g)
        return pool_candidates(mean, cand, self.kernel)

    def window_mask(self, view: CacheView, layer: int) -> torch.Tensor:
        """`[B, G, n]` bool: the `w` newest positions of each row (the window's own tokens)."""
        return view.positions[layer] >= view.next_position[:, None, None] - self.window

    def window_queries(self, view: CacheView, layer: int) -> torch.Tensor:
        """`[B, Hq, w', d]`: the recorded window of each row's slot (`w' <= w` only for a sequence
        shorter than the window so far)."""
        if not self._queries:
            raise RuntimeError("snapkv: no recorded queries (scorer used outside attach(), or observe() not called)")
        slots = view.slots.tolist()
        w = min(self._count.get(s, self.window) for s in slots)
        return self._queries[layer][view.slots.to(self._queries[layer].device)][:, :, self.window - w:]

    def importance(self, view: CacheView, layer: int) -> torch.Tensor:
        """`[B, G, n]` SnapKV importance of one layer, window tokens and padding 0 (before pooling)."""
        if self._rule == "group":
            return self._group_importance(view, layer)
        cand = ~self.window_mask(view, layer) & view.valid[layer]
        return window_importance(self.window_queries(view, layer), view.keys[layer], cand, self._scaling, self.kernel)

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: pooled importance, +inf on the window tokens, -inf on padding."""
        return torch.stack([self.importance(view, l).masked_fill(self.window_mask(view, l), float("inf"))
                            .masked_fill(~view.valid[l], float("-inf")) for l in range(view.num_layers)])
