"""The decoding family: how generation behaves on a compressed cache (a hook on each step's logits).

The engine calls `adjust(logits, rows, histories)` on the logits of every step (prefill included)
before sampling: `logits` `[R, V]` (one row per busy slot), `rows` the slots of those rows, and
`histories` the tokens each row's sequence has generated so far (host lists the engine keeps anyway:
reading them costs no device synchronisation). A mechanism returns the logits to sample from. The
base class is the identity (`none`, today's behaviour, bit for bit: it returns the same tensor).

Built-ins: `none`, and `loop-guard`, a bounded n-gram blocker against the degenerate repetition
that eviction provokes (in the committed real-signal runs, 12 of the 17 truncated full-cache answers
were loops). Its rule is the no-repeat n-gram constraint of Paulus et al. (2018, "A Deep Reinforced
Model for Abstractive Summarization", trigram blocking), relaxed to a window and a count so that the
short formulae a derivation legitimately repeats are left alone: a token is banned at a step when,
appended to the last `ngram - 1` tokens, it would complete an `ngram`-gram that already occurs
`max_repeats` times among the last `window` generated tokens. A loop of period `p <= window / 2`
repeats every one of its n-grams, so its `max_repeats + 1`-th repetition cannot be completed: the
guard forces the first token that leaves the loop. It never bans every token (the ban list of one
step holds at most `max_repeats`-many continuations of one prefix, far fewer than the vocabulary).

Plugins subclass `Decoding` (entry-point group `retention.decodings`, `module:Class`, `file.py:Class`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.runtime.settings import trivial_setting


@dataclass
class Decoding:
    """Base class and the `none` mechanism: logits pass through unchanged."""

    name: ClassVar[str] = "none"

    def reset_slot(self, slot: int, seed: int) -> None:
        """Engine slot `slot` starts a new sequence: drop that slot's state."""

    def adjust(self, logits: torch.Tensor, rows: list[int], histories: list[list[int]]) -> torch.Tensor:
        """The logits `[R, V]` to sample from; `rows[r]` is row `r`'s slot, `histories[r]` its tokens."""
        return logits

    def banned_count(self, slot: int) -> int:
        """Tokens this mechanism has banned in slot `slot`'s current sequence (recorded per record)."""
        return 0

    @classmethod
    def trivial(cls) -> dict | None:
        """Parameters under which this mechanism must behave exactly as `none` (checked), or None."""
        return None

    def is_trivial(self) -> bool:
        """Whether this instance is at a setting that behaves exactly as the family's default (its
        arm is then the default's cell: `retention.runs.canonical`); by default, `trivial()`'s keys
        at `trivial()`'s values."""
        return trivial_setting(self, self.trivial())


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
