"""What the engine (`retention.runtime.engine`) takes, keeps and hands back per sequence: a `Request`
in, its `SequenceState` while it decodes, its `Generation` when it ends, and the run's `EngineStats`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from retention.runtime.fidelity import Fidelity
from retention.runtime.meter import BudgetMeter
from retention.runtime.sampling import SamplingConfig
from retention.runtime.trace import CacheTrace


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"
    meter: BudgetMeter
    wall_seconds: float
    fidelity: Fidelity | None = None
    decode_seconds: list[float] = field(default_factory=list)  # per decode forward (of the whole batch)
    compaction_seconds: list[float] = field(default_factory=list)  # per compaction step (scoring + gather)
    step_logits: list[torch.Tensor] | None = None  # only with keep_logits=True (tests)
    trace: CacheTrace | None = None  # what the cache held (policy.tracer a CacheTracer: --trace)


@dataclass
class Request:
    """One sequence to decode: `key` comes back with its `Generation`; `seed` seeds its sampling."""

    key: object
    prompt_ids: list[int]
    seed: int = 0


@dataclass
class EngineStats:
    """Aggregate figures of one engine run (for progress bars and benchmarks)."""

    finished: int = 0
    tokens: int = 0
    busy: int = 0
    steps: int = 0
    decode_seconds: float = 0.0
    compaction_seconds: float = 0.0
    prefill_seconds: float = 0.0
    prefill_batches: int = 0  # prefill forwards (one per prompt alone; one per chunk of prompts together)
    start_seconds: float = 0.0  # starting sequences: prefills, prefill compactions, first tokens (`_admit`)
    shared_prefills: int = 0  # prompts that started from a copy of the previous identical prompt's forward
    fidelity_seconds: float = 0.0  # the reference forward and the KL figures of the decode steps
    allocated_bytes: int = 0
    host_syncs: int = 0  # deliberate host reads of decode steps (the docstring's one per step)
    start_syncs: int = 0  # deliberate host reads of sequence starts (one per started sequence)
    padding_rows: int = 0  # row-steps decoded for a padding row (what a run's tail costs)
    rows: int = 0  # rows of the last decode step (the slot count, fewer once the tail narrowed)
    narrowed: int = 0  # times the tail moved its sequences onto fewer rows
    narrow_refused: int = 0  # 1 when the probe or the step's comparison refused a narrowing (rows kept)
    tail_seconds: float = 0.0  # the narrowings' probes, row copies and checking forwards
    tail_syncs: int = 0  # host reads of those narrowings (their comparisons)
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def tokens_per_second(self) -> float:
        dt = time.perf_counter() - self.t_start
        return self.tokens / dt if dt > 0 else 0.0


@dataclass
class SequenceState:
    """One sequence in flight: its request, meter, sampler, fidelity record, tokens and timings."""

    req: Request
    meter: BudgetMeter
    gen: torch.Generator | None
    fid: Fidelity | None
    t0: float
    out: list[int] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    compact_s: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    finish: str | None = None
    slot: int = 0

    def stop(self, tok: int, eos: set[int], sampling: SamplingConfig) -> bool:
        """After appending `tok`: whether the sequence ends here, and why (`finish`: "eos" or "length")."""
        if tok in eos and not sampling.ignore_eos:
            self.finish = "eos"
        elif len(self.out) >= sampling.max_new_tokens:
            self.finish = "length"
        return self.finish is not None
