"""`retention run` on the reference modules (`ArchLM`, or a DeepSeek checkpoint on the reference
MLA: `retention.arch.deepseek`): sampled decoding under retention.

The same contract as `retention.engine.run_engine` (requests in, one `Generation` per request to
`on_finish`, the same `BudgetMeter` and `Fidelity` records), one sequence at a time. Not batched
(yet): rows of different lengths in a `LayoutCache` would need padded positions per sharing group
and per-row compaction, which the batched engine (`retention.engine`) has for transformers' caches
only.

Per sequence: the prompt is prefilled in one forward (the meter's `prefill_tokens`), then each step
forwards the last sampled token at its absolute position; the meter records the tokens stored per
layer that the step attended to, then the cadence compacts every sharing group when it is due
(`retention.arch.retention.compact`). Sampling is `retention.engine`'s (greedy at temperature 0,
else temperature + top-p with a generator seeded by the request's seed), so a record does not
depend on the batch it would have been decoded in. With `fidelity`, a second, never compacted
cache decodes the same tokens and each forward records KL(p_full || p_retained) and top-1 agreement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from retention.arch import retention as arch_retention
from retention.arch.model import LayoutLM
from retention.cadence import Cadence
from retention.engine import Fidelity, Generation, Request, SamplingConfig, sample_next
from retention.meter import BudgetMeter

# Scorer parameters a layout cache takes (the rest of a harness scorer's are refused by validation).
PARAMS = ("window", "kernel")


def _forward(model: LayoutLM, ids: list[int], start: int, cache) -> torch.Tensor:
    """Forward `ids` at positions `start...`; the next-token logits `[V]`."""
    dev = model.device
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    return model(torch.tensor([ids], device=dev), pos, cache, logits_to_keep=1).logits[0, -1]


@torch.no_grad()
def generate_one(model: LayoutLM, request: Request, scorer: str, params: dict, cadence: Cadence,
                 sampling: SamplingConfig, eos_ids: set[int], kib_per_token: float, *, fidelity: bool = False,
                 on_step: Callable[[object, BudgetMeter], None] | None = None) -> Generation:
    """Decode one request under `scorer` (a name of `arch_retention.SCORERS`) and `cadence`.

    on_step(cache, meter): called after every forward and its compaction (tests read the cache).
    """
    t0 = time.perf_counter()
    prompt = list(request.prompt_ids)
    P = len(prompt)
    group = arch_retention.GroupScorer(scorer, seed=request.seed, **{k: v for k, v in params.items() if k in PARAMS})
    evicts = group.evicts and cadence.evicts
    full_length = P + sampling.max_new_tokens
    # Buffers of b + N tokens under a budget (the most a row stores before it compacts).
    cache = model.new_cache(cadence.keep(P) + cadence.interval if evicts else full_length)
    group.attach(cache)
    ref = model.new_cache(full_length) if fidelity else None
    fid = Fidelity() if fidelity else None
    meter = BudgetMeter(kib_per_token=kib_per_token, budget=cadence.budget)
    gen = None
    if sampling.temperature > 0:
        gen = torch.Generator(device=model.device).manual_seed(request.seed)
    decode_s, compact_s, out = [], [], []

    def after_forward(next_position: int, prefill: bool) -> None:
        stored = cache.stored_lengths()
        if prefill:
            meter.record_prefill(stored)
        else:
            meter.record(stored)
        if evicts and cadence.due(max(stored), prefill, P):
            t = time.perf_counter()
            arch_retention.compact(cache, group, cadence, next_position, P)
            compact_s.append(time.perf_counter() - t)
            meter.note_compaction(cache.stored_lengths())
        if on_step is not None:
            on_step(cache, meter)

    logits = _forward(model, prompt, 0, cache)
    if fid is not None:
        fid.add(_forward(model, prompt, 0, ref), logits)
    after_forward(P, prefill=True)
    finish = None
    while finish is None:
        tok = sample_next(logits, sampling, gen)
        out.append(tok)
        if tok in eos_ids and not sampling.ignore_eos:
            finish = "eos"
        elif len(out) >= sampling.max_new_tokens:
            finish = "length"
        else:
            t = time.perf_counter()
            logits = _forward(model, [tok], P + len(out) - 1, cache)
            decode_s.append(time.perf_counter() - t)
            if fid is not None:
                fid.add(_forward(model, [tok], P + len(out) - 1, ref), logits)
            after_forward(P + len(out), prefill=False)
    return Generation(out, finish, meter, time.perf_counter() - t0, fid, decode_s, compact_s)


def run_arch(model: LayoutLM, requests: Sequence[Request], scorer: str, params: dict, cadence: Cadence,
             sampling: SamplingConfig, eos_ids: set[int], kib_per_token: float, *, fidelity: bool = False,
             on_finish: Callable[[Request, Generation], None] | None = None) -> None:
    """Decode every request in order; `on_finish(request, generation)` as each one ends."""
    for req in requests:
        g = generate_one(model, req, scorer, params, cadence, sampling, eos_ids, kib_per_token, fidelity=fidelity)
        if on_finish is not None:
            on_finish(req, g)
