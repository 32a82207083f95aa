"""A retention policy = a scorer + a cadence. The generation loop only calls `after_forward`."""

from __future__ import annotations

from dataclasses import dataclass

from retention.cache import RetentionCache
from retention.cadence import Cadence
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
