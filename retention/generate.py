"""The generation loop: prefill, then one token per step through a `RetentionCache`.

The loop never knows which scorer runs: after every forward it hands the cache to the policy
(`RetentionPolicy.after_forward`), which may compact it. Every forward gets explicit absolute
`position_ids` (a compacted cache is shorter than the sequence). Batch size is 1.

With `fidelity=True` the same model also decodes the same tokens through transformers'
`DynamicCache` (the full cache), and each step records the KL divergence KL(p_full || p_retained)
between the two next-token distributions and whether their top-1 tokens agree.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from retention.cache import RetentionCache
from retention.meter import BudgetMeter
from retention.policy import RetentionPolicy


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


@dataclass
class Fidelity:
    """Per-step agreement of the retained cache with the full cache along the same tokens."""

    kl: list[float] = field(default_factory=list)
    top1_agree: list[bool] = field(default_factory=list)

    def add(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """ref_logits, logits: `[V]` next-token logits (full cache, retained cache)."""
        p_log = torch.log_softmax(ref_logits.double(), -1)
        q_log = torch.log_softmax(logits.double(), -1)
        self.kl.append(max(0.0, float((p_log.exp() * (p_log - q_log)).sum())))
        self.top1_agree.append(bool(ref_logits.argmax() == logits.argmax()))

    def summary(self) -> dict:
        n = len(self.kl)
        first = next((i for i, a in enumerate(self.top1_agree) if not a), None)
        return {
            "kl_mean": sum(self.kl) / n if n else 0.0,
            "kl_max": max(self.kl) if n else 0.0,
            "top1_agreement": sum(self.top1_agree) / n if n else 1.0,
            "first_divergence_step": first,
            "steps": n,
        }


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"
    meter: BudgetMeter
    wall_seconds: float
    fidelity: Fidelity | None = None
    decode_seconds: list[float] = field(default_factory=list)  # per decode forward
    compaction_seconds: list[float] = field(default_factory=list)  # per compaction (scoring + gather)
    step_logits: list[torch.Tensor] | None = None  # only with keep_logits=True (tests)


def _now(device: torch.device) -> float:
    """Wall clock after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _cache_kwarg(model) -> str:
    """transformers is renaming the forward's cache argument (`past_key_values` -> `cache`)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_step(model, input_ids: torch.Tensor, positions: torch.Tensor, cache, cache_kw: str) -> torch.Tensor:
    """One forward with explicit absolute positions; returns the last position's logits `[V]`."""
    if isinstance(cache, RetentionCache):
        cache.set_step_positions(positions)
    out = model(input_ids=input_ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
    return out.logits[0, -1]


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling with `gen`."""
    if cfg.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, -1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


def generate(
    model,
    prompt_ids: list[int],
    policy: RetentionPolicy,
    sampling: SamplingConfig,
    eos_token_ids: set[int],
    kib_per_token: float,
    fidelity: bool = False,
    keep_logits: bool = False,
    on_token=None,
) -> Generation:
    """Decode one sequence under `policy`. `on_token(n_generated, meter)` is called after each token."""
    device = next(model.parameters()).device
    cache_kw = _cache_kwarg(model)
    num_layers = model.config.get_text_config().num_hidden_layers
    cache = RetentionCache(num_layers)
    ref_cache = DynamicCache(config=model.config) if fidelity else None
    meter = BudgetMeter(kib_per_token=kib_per_token, budget=policy.cadence.budget)
    fid = Fidelity() if fidelity else None
    gen = None
    if sampling.temperature > 0:
        gen = torch.Generator(device=device).manual_seed(sampling.seed)
    out_ids: list[int] = []
    all_logits: list[torch.Tensor] | None = [] if keep_logits else None
    finish = "length"
    decode_s: list[float] = []
    compact_s: list[float] = []
    t0 = _now(device)
    with torch.inference_mode(), policy.attach(model):
        ids = torch.tensor([prompt_ids], device=device)
        pos = torch.arange(len(prompt_ids), device=device)[None]
        logits = forward_step(model, ids, pos, cache, cache_kw)
        meter.record_prefill(cache.stored_lengths())
        if fid is not None:
            ref = forward_step(model, ids, pos, ref_cache, cache_kw)
            fid.add(ref, logits)
        t_c = _now(device)
        if policy.after_forward(cache, len(prompt_ids), meter, prefill=True):
            compact_s.append(_now(device) - t_c)
        while True:
            if all_logits is not None:
                all_logits.append(logits.clone())
            tok = sample_next(logits, sampling, gen)
            out_ids.append(tok)
            if on_token is not None:
                on_token(len(out_ids), meter)
            if tok in eos_token_ids and not sampling.ignore_eos:
                finish = "eos"
                break
            if len(out_ids) >= sampling.max_new_tokens:
                break
            position = len(prompt_ids) + len(out_ids) - 1
            ids = torch.tensor([[tok]], device=device)
            pos = torch.tensor([[position]], device=device)
            t_step = _now(device)
            logits = forward_step(model, ids, pos, cache, cache_kw)
            decode_s.append(_now(device) - t_step)
            meter.record(cache.stored_lengths())
            if fid is not None:
                fid.add(forward_step(model, ids, pos, ref_cache, cache_kw), logits)
            t_c = _now(device)
            if policy.after_forward(cache, position + 1, meter, prefill=False):
                compact_s.append(_now(device) - t_c)
    wall = _now(device) - t0
    return Generation(out_ids, finish, meter, wall, fid, decode_s, compact_s, all_logits)
