"""The engine interface and the record writer shared by every external engine.

An `Engine` generates `Request`s (prompt token ids, the per-(problem, sample) seed) under one
sampling configuration and yields `Completion`s in any order. `run_engine_arms` builds the
requests from the problems exactly as `retention.runs.runner.run_arms` does (chat template, seeds,
shard filter, resume), and writes records with the same schema: for a non-evicting arm the meter
fields follow from the sequence lengths alone (the cache holds prompt + generated tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tqdm import tqdm

from protocol import grading
from retention.errors import RetentionError
from retention.models import format_prompt, output_text
from retention.runs.runner import derive_seed, make_record
from retention.runs.shard import shard_pairs
from retention.runtime.meter import BudgetMeter
from retention.policy.registry import get_scorer_class


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


def build_record(c: Completion, *, config_hash: str, text: str, gold, cadence, kib_per_token: float,
                 batch_size: int, grader=None, problem: str | None = None) -> tuple[dict, tuple[list[int], list[float]]]:
    """The record of one completion (`retention.runs.runner.make_record`) and its cache trace."""
    meter = full_cache_meter(len(c.request.prompt_ids), len(c.token_ids), kib_per_token)
    record = make_record(config_hash=config_hash, problem_id=c.request.problem_id, sample=c.request.sample,
                         seed=c.request.seed, prompt_tokens=len(c.request.prompt_ids), token_ids=c.token_ids,
                         text=text, finish_reason=c.finish_reason, meter=meter, cadence=cadence,
                         wall_seconds=c.wall_seconds, batch_size=batch_size, gold=gold, grader=grader,
                         problem=problem)
    return record, meter.trace()


def refuse_evicting(arm_specs, engine_name: str) -> None:
    """Another engine has no retention cache: an evicting scorer would silently run full-cache."""
    evicting = [spec.name for spec in arm_specs if get_scorer_class(spec.name).evicts]
    if evicting:
        raise RetentionError(f"--engine {engine_name} runs non-evicting arms only (full): {evicting} evict tokens "
                             "inside this project's cache, which another engine does not have; run them with "
                             "--engine hf")


def run_engine_arms(engine: Engine, tokenizer, kib_per_token: float, arms, problems, *, samples: int,
                    base_seed: int, sampling: dict, eos_ids: set[int], grade: bool = True, shard=None,
                    batch: int = 64, progress: bool = True, prompt_style: str = "chat") -> None:
    """Generate every missing (problem, sample) record of every arm through `engine`, `batch`
    requests at a time (records are flushed after each batch, so an interrupted run resumes)."""
    grader = grading.grade if grade else None
    pairs = [(problems[i], s) for i, s in shard_pairs(len(problems), samples, shard)]
    gold = {p.unique_id: getattr(p, "answer", None) for p, _ in pairs}
    text_of = {p.unique_id: getattr(p, "problem", None) for p, _ in pairs}
    prompts: dict[str, list[int]] = {}
    bar = tqdm(total=len(pairs) * len(arms), disable=not progress, unit="gen", dynamic_ncols=True)
    for arm in arms:
        todo = [(p, s) for p, s in pairs if not arm.run.records.has(p.unique_id, s)]
        bar.update(len(pairs) - len(todo))
        for start in range(0, len(todo), batch):
            requests = [Request(p.unique_id, s, derive_seed(base_seed, p.unique_id, s),
                                prompts.setdefault(p.unique_id, format_prompt(tokenizer, p.problem, prompt_style)))
                        for p, s in todo[start:start + batch]]
            t0 = time.perf_counter()
            done = {(c.request.problem_id, c.request.sample): c for c in engine.complete(requests, sampling, eos_ids)}
            missing = [(r.problem_id, r.sample) for r in requests if (r.problem_id, r.sample) not in done]
            if missing:
                raise RetentionError(f"engine {engine.name} returned no completion for {missing[0]}")
            for c in (done[(r.problem_id, r.sample)] for r in requests):  # run order, whatever the engine's
                text = output_text(tokenizer, c.request.prompt_ids, c.token_ids)
                record, (steps, tokens) = build_record(c, config_hash=arm.run.hash, text=text,
                                                       gold=gold[c.request.problem_id], cadence=arm.spec.cadence,
                                                       kib_per_token=kib_per_token, batch_size=batch,
                                                       grader=grader, problem=text_of[c.request.problem_id])
                arm.run.append_trace(c.request.problem_id, c.request.sample, steps, tokens)
                arm.run.records.append(record)
                bar.update(1)
            bar.set_postfix_str(f"{arm.spec.name} on {engine.name}: {time.perf_counter() - t0:.1f} s per batch",
                                refresh=True)
    bar.close()
