"""The `newline` cadence: compact at the first line break after the interval (`retention.policy.cadence.base`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from retention.errors import RetentionError
from retention.policy.cadence.base import Cadence


@dataclass(frozen=True)
class NewlineCadence(Cadence):
    """Compact at the first line break after `b + N` stored tokens, at the latest at `b + N + max_wait`
    (module docstring: `span = N + max_wait`, so `b = B - span//2 - 1` in mean accounting)."""

    name: ClassVar[str] = "newline"
    max_wait: int = 32
    _newlines: set = field(default_factory=set, init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.max_wait < 0:
            raise RetentionError(f"newline.max_wait must be >= 0, got {self.max_wait}")
        super().__post_init__()

    @property
    def span(self) -> int:
        return self.interval + self.max_wait

    @classmethod
    def trivial(cls) -> dict | None:
        return {"max_wait": 0}  # due at b + N whatever the token: the fixed cadence

    def params(self) -> dict:
        return {"max_wait": self.max_wait}

    def prepare(self, tokenizer) -> None:
        if tokenizer is None:
            return
        vocab = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(vocab)])
        self._newlines.clear()
        self._newlines.update(i for i, t in enumerate(texts) if "\n" in t)

    def due(self, stored, prefill, prompt_length=0, token=None) -> bool:
        if self.budget is None:
            return False
        if prefill:
            return (not self.protect_prompt) and stored > self.nominal
        above = stored - (prompt_length if self.protect_prompt else 0) - self.nominal
        if above >= self.span:
            return True
        return above >= self.interval and token in self._newlines
