"""The budget meter: what the cache really held, step by step.

At every decode step (one forward of one new token) the meter records the number of physically
stored tokens per layer that the step attended to, its own key included (every KV head of a layer
stores the same number, so one count per layer describes all of its heads). The prefill forward is
recorded separately (`prefill_tokens`): it is prompt processing, not decoding, and it precedes the
first compaction.

Summaries: the mean over decode steps (the project's budget is this number), the peak, the final
length, the number of compactions, and a per-step trace downsampled to at most `max_trace` points.
Tokens convert to bytes with the model's cache layout (`retention.models.layouts`: `kib_per_token`), which
counts the compressed representation kept per token, not allocated buffers (`counts` says so).

A second reading counts this engine's buffers: the slots a row occupies per (layer, KV head), its
width, holes included (`cache_mean_buffer_tokens`). Under an allocating routing (PyramidKV, AdaKV)
heads keep different counts, and the cache's `[rows, heads, capacity]` buffers pad every head to the
row's widest, so this reading exceeds the stored tokens; with a uniform allocation they are equal.
The budget holds the stored tokens (what a flat store with per-head offsets, as AdaKV's reference
keeps, would hold); the buffer reading says what this implementation allocated for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BudgetMeter:
    """Per-step stored-token counts of one generation.

    kib_per_token: KiB of K+V per stored token for the whole model at the run's dtype.
    budget: the run's budget `B` (None for no eviction); `exceeded` compares the measured mean to it.
    """

    kib_per_token: float
    budget: int | None = None
    budget_kib: float | None = None  # --budget-bytes: the mean KiB is held to it too
    counts: str = "compressed representation"
    max_trace: int = 512
    prefill_tokens: int = 0
    compactions: int = 0
    _sum: float = 0.0
    _steps: int = 0
    _peak: int = 0
    _final: int = 0
    _trace: list[tuple[int, float]] = field(default_factory=list)
    _stride: int = 1
    _kib_sum: float = 0.0
    _kib_peak: float = 0.0
    _kib_steps: int = 0  # steps whose bytes a state reported (0: every token in full precision)
    _buffer_sum: float = 0.0

    def record_prefill(self, lengths: list[int]) -> None:
        self.prefill_tokens = max(lengths)
        self._final = max(lengths)

    def record(self, lengths: list[int], kib: float | None = None, buffer: int | None = None) -> None:
        """Stored tokens per layer that the decode step just attended to; `kib`: the KiB the row
        stores when a state keeps tokens in another representation (None: tokens x kib_per_token);
        `buffer`: the row's buffer width per (layer, KV head), holes included (None: no holes)."""
        mean = sum(lengths) / len(lengths)
        self._buffer_sum += mean if buffer is None else buffer
        if kib is not None or self._kib_steps:
            kib = mean * self.kib_per_token if kib is None else kib
            self._kib_sum += kib
            self._kib_peak = max(self._kib_peak, kib)
            self._kib_steps += 1
        self._sum += mean
        self._peak = max(self._peak, max(lengths))
        self._final = max(lengths)
        if self._steps % self._stride == 0:
            self._trace.append((self._steps, mean))
            if len(self._trace) > self.max_trace:
                # Halve the resolution: keep every other point, double the stride.
                self._trace = self._trace[::2]
                self._stride *= 2
        self._steps += 1

    def note_compaction(self, lengths: list[int]) -> None:
        self.compactions += 1
        self._final = max(lengths)

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def mean(self) -> float:
        """Mean stored tokens over decode steps; with no decode step, what the prefill left stored."""
        return self._sum / self._steps if self._steps else float(self._final)

    @property
    def peak(self) -> int:
        return self._peak if self._steps else self._final

    @property
    def final(self) -> int:
        return self._final

    @property
    def mean_kib(self) -> float:
        """Mean KiB stored over decode steps (what a state reported, else tokens x kib_per_token)."""
        if self._kib_steps and self._kib_steps == self._steps:
            return self._kib_sum / self._kib_steps
        return self.mean * self.kib_per_token

    @property
    def peak_kib(self) -> float:
        """The most KiB stored at a decode step (what a state reported, else peak tokens x kib_per_token):
        what a fixed memory must hold per sequence."""
        if self._kib_steps and self._kib_steps == self._steps:
            return self._kib_peak
        return self.peak * self.kib_per_token

    @property
    def mean_buffer(self) -> float:
        """Mean buffer slots per (layer, KV head) over decode steps, holes included (module doc)."""
        return self._buffer_sum / self._steps if self._steps else float(self._final)

    @property
    def exceeded(self) -> bool:
        """The measured mean is above the budget (the project's definition, whatever the mode), in
        tokens or, with a byte budget, in KiB."""
        over_kib = self.budget_kib is not None and self.mean_kib > self.budget_kib * (1 + 1e-12)
        return (self.budget is not None and self.mean > self.budget) or over_kib

    def trace(self) -> tuple[list[int], list[float]]:
        """(decode step indices, mean stored tokens across layers at that step), downsampled."""
        return [s for s, _ in self._trace], [v for _, v in self._trace]

    def summary(self) -> dict:
        return {
            "cache_mean_tokens": self.mean,
            "cache_peak_tokens": self.peak,
            "cache_final_tokens": self.final,
            "cache_prefill_tokens": self.prefill_tokens,
            "kib_per_token": self.kib_per_token,
            "kib_counts": self.counts,
            "cache_mean_kib": self.mean_kib,
            "cache_mean_buffer_tokens": self.mean_buffer,
            "budget_exceeded": self.exceeded,
            "compactions": self.compactions,
            "decode_steps": self.steps,
        }
