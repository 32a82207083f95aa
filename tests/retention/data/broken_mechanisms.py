"""Broken mechanisms, one per way a mechanism can misreport itself (issue 46), for the contract kit's
tests (`tests/retention/contract/test_distrust.py`): each must fail a named check of `retention check`,
and `run` must refuse it at its first compaction before writing a record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.policy.cadence.base import Cadence
from retention.policy.decoding.base import Decoding
from retention.policy.routing.base import Routing
from retention.policy.state.base import State


@dataclass
class ClaimsInt4(State):
    """Stores full precision, reports int4 bytes."""

    name: ClassVar[str] = "claims-int4"
    bits: int = 4
    group: int = 16

    def row_kib(self, cache, row, kib_per_token):
        return cache.lengths[row] * kib_per_token / 4

    def stored_kib(self, cache, row, kib_per_token):  # agrees with itself: only a recount can tell
        return self.row_kib(cache, row, kib_per_token)


@dataclass
class NanBytes(State):
    """Reports NaN KiB."""

    name: ClassVar[str] = "nan-bytes"

    def row_kib(self, cache, row, kib_per_token):
        return float("nan")

    def stored_kib(self, cache, row, kib_per_token):
        return float("nan")


@dataclass
class KeepsThreeMore(Routing):
    """Keeps three tokens more than the allocation per head (the scorer's selection is right)."""

    name: ClassVar[str] = "keeps-three-more"

    def select(self, scorer, scores, view, k):
        keep = scorer.select(scores, view, k)  # [.., k] ascending
        n = scores.shape[-1]
        if n < k + 3:
            return keep
        free = torch.ones(scores.shape, dtype=torch.bool).scatter(-1, keep, False)  # [.., n]
        # The first three tokens it did not keep, by position (a cumulative count picks them per head).
        first = free & (free.long().cumsum(-1) <= 3)
        others = first.nonzero()[:, -1].view(*keep.shape[:-1], 3)
        return torch.cat([keep, others], -1).sort(-1).values


@dataclass
class OneColumnShort(Decoding):
    """Returns logits one vocabulary column short: the last token can never be drawn."""

    name: ClassVar[str] = "one-column-short"

    def adjust(self, logits, rows, histories):
        return logits[:, :-1]


@dataclass(frozen=True)
class NeverDue(Cadence):
    """Says rows are never due after the prefill: a row outgrows b + span."""

    name: ClassVar[str] = "never-due"

    def due(self, stored, prefill, prompt_length=0, token=None):
        return prefill and super().due(stored, prefill, prompt_length, token)
