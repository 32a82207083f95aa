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

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.policy.settings import TrivialSetting


@dataclass
class Decoding(TrivialSetting):
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

