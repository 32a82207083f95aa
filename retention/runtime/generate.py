"""Single-sequence generation: the batched engine (`retention.runtime.engine`) with one slot.

Prefill, then one token per step through a `RetentionCache`; after every forward the policy may
compact the cache (`RetentionPolicy.after_forward`). Every forward gets explicit absolute
`position_ids` (a compacted cache is shorter than the sequence).

With `fidelity=True` the same model also decodes the same tokens through a full (never compacted)
cache, and each step records the KL divergence KL(p_full || p_retained) between the two next-token
distributions and whether their top-1 tokens agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retention.models.layouts import layout_from_config, tokens_for_bytes
from retention.runtime.engine import (Fidelity, Generation, ModelAdapter, Request, SamplingConfig, cache_kwarg, forward_step,
                              run_engine, sample_next)
from retention.runtime.meter import BudgetMeter
from retention.runtime.policy import RetentionPolicy, cadence_for
from retention.scorers import make_scorer

__all__ = ["Fidelity", "Generation", "SamplingConfig", "forward_step", "generate", "sample_next", "cache_kwarg",
           "decode"]


def generate(model, prompt_ids: list[int], policy: RetentionPolicy, sampling: SamplingConfig, eos_token_ids: set[int],
             kib_per_token: float, fidelity: bool = False, keep_logits: bool = False, on_token=None) -> Generation:
    """Decode one sequence under `policy`. `on_token(n_generated, meter)` is called after each token."""
    out: list[Generation] = []
    run_engine(model, [Request(0, list(prompt_ids), sampling.seed)], policy, sampling, eos_token_ids, kib_per_token,
               batch_size=1, fidelity=fidelity, keep_logits=keep_logits, on_finish=lambda _r, g: out.append(g),
               on_token=on_token)
    return out[0]

_cache_kwarg = cache_kwarg  # the name tests and older callers import


@dataclass
class TeacherForced:
    logits: list[torch.Tensor]  # per decoded position: next-token logits [V]
    stored: list[int]  # stored tokens after each forward (and its compaction)
    stored_bytes: list[int]  # bytes of the stored tensors after each forward
    compactions: int


@torch.no_grad()
def decode(model, token_ids: list[int], prompt_length: int, scorer: str = "full", *, budget: int | None = None,
           budget_bytes: int | None = None, interval: int | None = None, sink: int = 4, seed: int = 0,
           window: int | None = None, on_compaction=None) -> TeacherForced:
    """Teacher-forced decode of `token_ids` (the first `prompt_length` as one prefill, then one token
    per step) of any model the engine runs, through the engine's adapter, cache and policy; the
    logits after each forward and what the cache held. `on_compaction(cache)` after each compaction."""
    adapter = ModelAdapter(model)
    sc = make_scorer(scorer, window=window)
    if budget_bytes is not None:
        layout = adapter.layout or layout_from_config(model.config, adapter.dtype)
        budget = tokens_for_bytes(layout, budget_bytes)
    policy = RetentionPolicy(sc, cadence_for(sc, budget, interval, sink=sink))
    cache = adapter.new_cache(None, sc)
    cache.slots, cache.prompt_lengths = [0], [prompt_length]
    policy.reset()
    policy.reset_slot(0, seed)
    meter = BudgetMeter(kib_per_token=1.0, budget=policy.cadence.budget)
    dev = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=dev)
    logits, stored, stored_bytes, compactions = [], [], [], 0
    steps = [(0, prompt_length)] + [(i, i + 1) for i in range(prompt_length, len(token_ids))]
    with policy.attach(model):
        for start, end in steps:
            pos = torch.arange(start, end, device=dev)[None]
            logits.append(adapter.forward(ids[:, start:end], pos, cache)[0])
            if policy.after_forward(cache, end, meter, prefill=start == 0):
                compactions += 1
                if on_compaction is not None:
                    on_compaction(cache)
            stored.append(max(cache.lengths))
            stored_bytes.append(cache.stored_bytes())
    return TeacherForced(logits, stored, stored_bytes, compactions)
