"""The `loop-guard` decoding (`retention.policy.decoding.base`, module doc)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.decoding.base import Decoding


@dataclass
class LoopGuard(Decoding):
    """Bans a token that would complete an `ngram`-gram seen `max_repeats` times in the last `window`
    generated tokens (module docstring). State per slot: the counts of the n-grams in the window,
    updated incrementally (one n-gram enters and at most one leaves per token: O(1) per step)."""

    name: ClassVar[str] = "loop-guard"
    ngram: int = 12
    max_repeats: int = 2
    window: int = 1024
    _state: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if self.ngram < 2:
            raise RetentionError(f"loop-guard.ngram must be at least 2, got {self.ngram}")
        if self.max_repeats < 1:
            raise RetentionError(f"loop-guard.max_repeats must be at least 1, got {self.max_repeats}")
        if self.window < self.ngram:
            raise RetentionError(f"loop-guard.window ({self.window}) must be at least ngram ({self.ngram})")

    @classmethod
    def trivial(cls) -> dict | None:
        return {"max_repeats": 1 << 30}  # no n-gram repeats that often: nothing is banned

    def is_trivial(self) -> bool:
        # The window holds fewer n-grams than `window`: an n-gram seen more often than that is never
        # counted, so nothing is ever banned.
        return self.max_repeats > self.window

    def reset_slot(self, slot: int, seed: int) -> None:
        self._state[slot] = _SlotGrams(self.ngram, self.window)

    def banned_count(self, slot: int) -> int:
        st = self._state.get(slot)
        return 0 if st is None else st.banned

    def adjust(self, logits, rows, histories):
        bans: list[tuple[int, int]] = []
        for r, (slot, hist) in enumerate(zip(rows, histories, strict=True)):
            st = self._state.setdefault(slot, _SlotGrams(self.ngram, self.window))
            st.catch_up(hist)
            for tok in st.continuations(hist, self.max_repeats):
                bans.append((r, tok))
        if not bans:
            return logits
        for r, _ in bans:
            self._state[rows[r]].banned += 1
        out = logits.clone()
        idx = torch.tensor(bans, device=logits.device)
        out[idx[:, 0], idx[:, 1]] = float("-inf")
        return out


class _SlotGrams:
    """The n-grams of one sequence's last `window` tokens: counts by (prefix, next token)."""

    def __init__(self, n: int, window: int):
        self.n, self.window = n, window
        self.seen = 0  # tokens of the history already counted
        self.grams: deque[tuple[tuple[int, ...], int]] = deque()
        self.counts: dict[tuple[int, ...], Counter] = {}
        self.banned = 0

    def catch_up(self, hist: list[int]) -> None:
        """Count the n-grams that end at the tokens added since the last call."""
        for end in range(max(self.seen, self.n), len(hist) + 1):
            prefix, tok = tuple(hist[end - self.n:end - 1]), hist[end - 1]
            self.grams.append((prefix, tok))
            self.counts.setdefault(prefix, Counter())[tok] += 1
            # An n-gram leaves once its first token is older than the window.
            while self.grams and len(self.grams) > self.window - self.n + 1:
                old_prefix, old_tok = self.grams.popleft()
                c = self.counts[old_prefix]
                c[old_tok] -= 1
                if c[old_tok] <= 0:
                    del c[old_tok]
                if not c:
                    del self.counts[old_prefix]
        self.seen = len(hist)

    def continuations(self, hist: list[int], limit: int) -> list[int]:
        """Tokens that would complete an n-gram already seen `limit` times after the current prefix."""
        if len(hist) < self.n - 1:
            return []
        c = self.counts.get(tuple(hist[len(hist) - self.n + 1:]))
        return [] if not c else [t for t, k in c.items() if k >= limit]
