"""`snapkv`: SnapKV run at decode time, from the last `window` queries of every layer.

Shapes: layers `L`, batch `B`, KV heads `G`, query heads `Hq = G * r`, window `w`, stored tokens `n`,
head dim `d`.

The post-RoPE queries are recorded as the model computes them (`retention.capture`), and the last `w`
of each layer are kept: they are never recomputed with the current step's rotation. At a
compaction, per layer and KV head:

1. logits of the `w` window queries against the candidate keys (every stored token except the
   window's own `w`, i.e. the `w` newest positions), times the model's attention scale;
2. max over the group's `r` query heads, on the raw logits;
3. softmax over the candidates in float32, mean over the `w` window queries;
4. 1-D max-pool over the stored order, kernel 7, stride 1, same padding (window slots are 0 there,
   which never wins a max over probabilities, so this equals pooling over the candidates alone);
5. top-`(b - w)` per (layer, KV head), plus the `w` window tokens (scored +inf: always kept).

Reference defaults: `w = 8`, kernel 7, interval 128. The scorer asks the cadence to protect at least
the `w` newest tokens (`min_recent`), so the budget accounting counts the window inside `b`.
(The original SnapKV is prefill-only with window 32, kernel-5 average pooling, per query head.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from retention.cache import CacheView
from retention.errors import RetentionError
from retention.scorers import register
from retention.scorers.base import WindowScorer


def window_importance(queries: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scaling: float,
                      kernel: int) -> torch.Tensor:
    """SnapKV importance of one layer (steps 1-4 of the module doc).

    queries `[B, Hq, w, d]`, keys `[B, G, n, d]`, candidates `[B, G, n]` bool -> `[B, G, n]` float32,
    zero on non-candidates before pooling.
    """
    B, G, n, d = keys.shape
    Hq, w = queries.shape[1], queries.shape[2]
    q = queries.float().reshape(B, G, Hq // G, w, d)
    logits = torch.einsum("bgrwd,bgnd->bgrwn", q, keys.float()).amax(dim=2) * scaling  # [B, G, w, n]
    logits = logits.masked_fill(~candidates[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0).mean(dim=2)  # all-masked rows -> 0, not NaN
    pooled = F.max_pool1d(probs.reshape(B * G, 1, n), kernel_size=kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(B, G, n)


@register("snapkv")
@dataclass
class SnapKV(WindowScorer):
    """Decode-time SnapKV. Parameters: `window` (recent queries and protected tokens, default 8),
    `kernel` (max-pool width, odd, default 7)."""

    kernel: int = 7
    # Per layer: the last `w` recorded queries of every slot, `[slots, Hq, w, d]` (a rolling window,
    # newest last), and how many of them are real so far per slot (a prompt may be shorter than `w`).
    _queries: list = field(default_factory=list, init=False, repr=False)
    _count: dict = field(default_factory=dict, init=False, repr=False)  # slot -> recorded queries (<= w)
    _scaling: float = field(default=1.0, init=False, repr=False)

    def __post_init__(self):
        super().__post_init__()
        if self.kernel <= 0 or self.kernel % 2 == 0:
            raise RetentionError(f"the pooling kernel must be a positive odd number, got {self.kernel}")

    def reset(self) -> None:
        self._queries, self._count = [], {}

    def reset_slot(self, slot: int, seed: int) -> None:
        self._count[slot] = 0

    def observe(self, cache, next_position: list[int]) -> None:
        """Roll this forward's queries of every row into its slot's window of the last `w`."""
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
        cand = ~self.window_mask(view, layer) & view.valid[layer]
        return window_importance(self.window_queries(view, layer), view.keys[layer], cand, self._scaling, self.kernel)

    def score(self, view: CacheView) -> torch.Tensor:
        """`[L, B, G, n]`: pooled importance, +inf on the window tokens, -inf on padding."""
        return torch.stack([self.importance(view, l).masked_fill(self.window_mask(view, l), float("inf"))
                            .masked_fill(~view.valid[l], float("-inf")) for l in range(view.num_layers)])
