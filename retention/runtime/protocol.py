"""What the engine asks of a retention policy: the runtime's own interface, `StepPolicy`.

The engine (`retention.runtime.engine`), its prefill (`retention.runtime.prefill`) and the
single-sequence loop (`retention.runtime.generate`) type against this protocol only, so the runtime
imports nothing of the mechanisms above it (`retention.policy.composite.RetentionPolicy` is the
implementation every run uses). Shapes: rows `R` of a step (a sequence slot each, padding
included), vocabulary `V`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch

from retention.runtime.cache import RetentionCache
from retention.runtime.trace import CacheTrace


class StepPolicy(Protocol):
    """A retention policy as the engine sees it, call by call."""

    # The token budget a row's meter holds (None: a policy that never evicts).
    budget: int | None
    # --budget-bytes: the mean KiB a row's meter holds too (None: no byte budget).
    budget_kib: float | None
    # Whether prompts that start together may share one prefill forward (False when the scorer reads
    # the forward itself: `Scorer.batch_prefill`).
    batch_prefill: bool

    def attach(self, model) -> AbstractContextManager:
        """The context the run's forwards run in (a scorer's query capture)."""

    def reading(self) -> tuple[frozenset[str], ...]:
        """What the policy reads, alternatives (`retention.policy.registry.READS` names the kinds):
        a new cache collects the attention the modules report only when it is read."""

    def capacity(self, prompt_length: int, max_new_tokens: int) -> int:
        """Tokens to preallocate per row: the most a row of a sequence with this prompt ever stores."""

    def reset(self) -> None:
        """A run starts: clear every per-run state."""

    def reset_slot(self, slot: int, seed: int) -> None:
        """Engine slot `slot` starts a new sequence whose seed is `seed`."""

    def after_forward(self, cache: RetentionCache, next_position, meter, prefill: bool,
                      tokens: list[int] | None = None) -> bool:
        """After each forward: observe it and compact the rows that are due; True if any was."""

    def adjust(self, logits: torch.Tensor, slots: list[int], histories: list[list[int]]) -> torch.Tensor:
        """The next-token logits `[R, V]` of the rows of `slots` (each with its generated ids so far)
        as they are sampled from."""

    def row_kib(self, cache: RetentionCache, row: int, kib_per_token: float) -> float | None:
        """KiB row `row` stores now (None: stored tokens x `kib_per_token`)."""

    def finish(self, slot: int, output_tokens: int, steps: int, fidelity=None) -> CacheTrace | None:
        """The sequence of `slot` ended: what its cache held (a `--trace` run), else None."""
