"""A retention policy = a scorer + a cadence. The generation loop only calls `after_forward`.

The cadence is per row (sequence slot): after a forward, every row whose own stored length reached
`b + N` (or its prompt exceeded `b`, at prefill) is due, and the scorer runs once over all the rows due
at that step (one `CacheView`, vectorised over them). Rows that keep different numbers of tokens (only
with `protect_prompt`, where the prompt is kept on top of `b`) are compacted in groups of equal size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from retention.runtime.cache import RetentionCache
from retention.runtime.cadence import Cadence, default_interval
from retention.runtime.meter import BudgetMeter

if TYPE_CHECKING:  # the type only: the scorers read this package's cache, the policy just calls them
    from retention.scorers.base import Scorer


@dataclass
class RetentionPolicy:
    scorer: Scorer
    cadence: Cadence

    def attach(self, model):
        return self.scorer.attach(model)

    def due_rows(self, cache: RetentionCache, prefill: bool) -> list[int]:
        if not self.scorer.evicts:
            return []
        return [r for r, n in enumerate(cache.lengths) if self.cadence.due(n, prefill, cache.prompt_lengths[r])]

    def after_forward(self, cache: RetentionCache, next_position, meter, prefill: bool) -> bool:
        """Let the scorer observe the step, then compact the rows that are due. Returns True if any was.

        next_position: the absolute position of each row's next query (a list, or one int for a
        single-row cache); meter: each row's `BudgetMeter` (a list, or one meter for a single row).
        """
        rows = cache.rows
        nxt = [int(next_position)] * rows if isinstance(next_position, int) else [int(t) for t in next_position]
        meters = [meter] * rows if isinstance(meter, BudgetMeter) else list(meter)
        self.scorer.observe(cache, nxt)
        due = self.due_rows(cache, prefill)
        if not due:
            return False
        groups: dict[int, list[int]] = {}
        for r in due:
            groups.setdefault(self.cadence.keep(cache.prompt_lengths[r]), []).append(r)
        c = self.cadence
        for k, grp in groups.items():
            view = cache.view([nxt[r] for r in grp], sink=c.sink, recent=c.recent, rows=grp,
                              prompt_length=[cache.prompt_lengths[r] for r in grp],
                              protect_prompt=c.protect_prompt, slots=[cache.slots[r] for r in grp])
            keep = self.scorer.select(self.scorer.score(view), view, k)
            cache.compact_rows(grp, keep)
            self.scorer.compacted(keep, view)
            for r in grp:
                meters[r].note_compaction([cache.lengths[r]])
        return True


def cadence_for(scorer: Scorer, budget: int | None, interval: int | None = None, accounting: str = "mean",
                sink: int | None = None, recent: int | None = None, protect_prompt: bool = False) -> Cadence:
    """The cadence of `scorer` at `budget`: no budget for a scorer that never evicts, the default
    interval `min(128, B)`, the scorer's own protected tokens unless `sink`/`recent` are given, and
    at least the window a window scorer always keeps (`min_recent`)."""
    budget = budget if scorer.evicts else None
    sink = scorer.default_sink if sink is None else sink
    recent = scorer.default_recent if recent is None else recent
    if hasattr(scorer, "min_recent"):
        recent = max(recent, scorer.min_recent())
    interval = interval or (default_interval(budget, accounting, max(1, sink + recent + 1)) if budget else 1)
    return Cadence(budget=budget, interval=interval, accounting=accounting, sink=sink, recent=recent,
                   protect_prompt=protect_prompt and budget is not None)
