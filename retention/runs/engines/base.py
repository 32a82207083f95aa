"""The engine interface every external engine implements.

An `Engine` generates `Request`s (prompt token ids, the per-(problem, sample) seed) under one
sampling configuration and yields `Completion`s in any order. The run side, which builds the
requests and writes the records, is `retention.runs.engine_runs` (above this package: the engines
import nothing of the runs). For a non-evicting arm the meter fields follow from the sequence
lengths alone (`full_cache_meter`: the cache holds prompt + generated tokens).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from retention.errors import RetentionError
from retention.runtime.meter import BudgetMeter


@dataclass(frozen=True)
class Request:
    problem_id: str
    sample: int
    seed: int
    prompt_ids: list[int]


@dataclass(frozen=True)
class Completion:
    request: Request
    token_ids: list[int]  # generated tokens, the stopping EOS included (as this project's engine does)
    finish_reason: str  # "eos" | "length"
    wall_seconds: float  # this request's share of the batch's wall time


class Engine(Protocol):
    name: str
    version: str

    def complete(self, requests: Sequence[Request], sampling: dict, eos_ids: set[int]) -> Iterator[Completion]:
        """sampling: `max_new_tokens`, `temperature` (0 = greedy), `top_p`, `ignore_eos`."""
        ...


def full_cache_meter(prompt_tokens: int, output_tokens: int, kib_per_token: float):
    """The `BudgetMeter` this project's engine fills for a full-cache generation: prefill of the
    prompt, then one decode step per generated token but the last, each attending to one more
    token. Fed step by step (integers, no tensors) so that summary and trace are identical."""
    meter = BudgetMeter(kib_per_token=kib_per_token, budget=None)
    meter.record_prefill([prompt_tokens])
    for step in range(1, output_tokens):
        meter.record([prompt_tokens + step])
    return meter


def refuse_evicting(arm_specs, engine_name: str) -> None:
    """Another engine has no retention cache: an evicting scorer would silently run full-cache."""
    evicting = [spec.name for spec in arm_specs if spec.scorer.cls.evicts]
    if evicting:
        raise RetentionError(f"--engine {engine_name} runs non-evicting arms only (full): {evicting} evict tokens "
                             "inside this project's cache, which another engine does not have; run them with "
                             "--engine hf")
