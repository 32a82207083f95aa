"""Single-sequence generation: the batched engine (`retention.runtime.engine`) with one slot.

Prefill, then one token per step through a `RetentionCache`; after every forward the policy may
compact the cache (`RetentionPolicy.after_forward`). Every forward gets explicit absolute
`position_ids` (a compacted cache is shorter than the sequence).

With `fidelity=True` the same model also decodes the same tokens through a full (never compacted)
cache, and each step records the KL divergence KL(p_full || p_retained) between the two next-token
distributions and whether their top-1 tokens agree. The teacher-forced decode of a whole token
sequence (`decode`) builds its own policy and lives above the runtime: `retention.runs.teacher_forced`.
"""

from __future__ import annotations

from retention.runtime.engine import (Fidelity, Generation, Request, SamplingConfig, cache_kwarg, forward_step, run_engine,
                                      sample_next)
from retention.runtime.protocol import StepPolicy

__all__ = ["Fidelity", "Generation", "SamplingConfig", "forward_step", "generate", "sample_next", "cache_kwarg"]


def generate(model, prompt_ids: list[int], policy: StepPolicy, sampling: SamplingConfig, eos_token_ids: set[int],
             kib_per_token: float, fidelity: bool = False, keep_logits: bool = False, on_token=None) -> Generation:
    """Decode one sequence under `policy`. `on_token(n_generated, meter)` is called after each token."""
    out: list[Generation] = []
    run_engine(model, [Request(0, list(prompt_ids), sampling.seed)], policy, sampling, eos_token_ids, kib_per_token,
               batch_size=1, fidelity=fidelity, keep_logits=keep_logits, on_finish=lambda _r, g: out.append(g),
               on_token=on_token)
    return out[0]

_cache_kwarg = cache_kwarg  # the name tests and older callers import
