"""Teacher-forced decode: a given token sequence through the engine's adapter, cache and a policy.

The first `prompt_length` tokens are one prefill, then one token per step; after each forward the
policy may compact the cache (`RetentionPolicy.after_forward`). What it records per forward: the
next-token logits, the tokens and bytes stored (the layout figures: `scripts/layout_figures.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retention.models.layouts import layout_from_config, tokens_for_bytes
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.policy.registry import make_scorer
from retention.runtime.adapter import ModelAdapter
from retention.runtime.meter import BudgetMeter


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
