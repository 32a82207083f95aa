"""A retention policy = a scorer + a cadence. The generation loop only calls `after_forward`."""

from __future__ import annotations

from dataclasses import dataclass

from retention.cache import RetentionCache
from retention.cadence import Cadence, default_interval
from retention.meter import BudgetMeter
from retention.scorers.base import Scorer


@dataclass
class RetentionPolicy:
    scorer: Scorer
    cadence: Cadence

    def attach(self, model):
        return self.scorer.attach(model)

    def after_forward(self, cache: RetentionCache, next_position: int, meter: BudgetMeter, prefill: bool) -> bool:
        """Let the scorer observe the step, then compact if the cadence says so. Returns True if it did."""
        self.scorer.observe(cache, next_position)
        if not self.scorer.evicts:
            return False
        stored = max(cache.stored_lengths())
        if not self.cadence.due(stored, prefill):
            return False
        view = cache.view(next_position, sink=self.cadence.sink, recent=self.cadence.recent)
        keep = self.scorer.select(self.scorer.score(view), view, self.cadence.nominal)
        cache.compact(keep)
        self.scorer.compacted(keep)
        meter.note_compaction(cache.stored_lengths())
        return True


def cadence_for(scorer: Scorer, budget: int | None, interval: int | None = None, accounting: str = "mean",
                sink: int | None = None, recent: int | None = None) -> Cadence:
    """The cadence of `scorer` at `budget`: no budget for a scorer that never evicts, the default
    interval `min(128, B)`, the scorer's own protected tokens unless `sink`/`recent` are given, and
    at least the window a window scorer always keeps (`min_recent`)."""
    budget = budget if scorer.evicts else None
    sink = scorer.default_sink if sink is None else sink
    recent = scorer.default_recent if recent is None else recent
    if hasattr(scorer, "min_recent"):
        recent = max(recent, scorer.min_recent())
    interval = interval or (default_interval(budget, accounting, max(1, sink + recent + 1)) if budget else 1)
    return Cadence(budget=budget, interval=interval, accounting=accounting, sink=sink, recent=recent)
