"""Sampling the next token of each row: greedy (a batched argmax) or temperature + nucleus (top-p)
sampling with one `torch.Generator` per row, so that a row's draw never depends on the other rows.
Tokens stay on the device (`sample_tokens`): the engine reads them on the host once per step.

The nucleus (`nucleus`) keeps every token as probable as the last one the prefix rule keeps, so it
does not depend on how a sort orders equal probabilities (frequent in bfloat16 logits). Earlier
versions kept an arbitrary part of such a tie at the boundary (the order of an unstable sort of the
whole vocabulary); a sampled record differs from theirs only where that happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


# Candidates a CPU sorts for the nucleus (a full sort of a 49k-151k vocabulary costs 2-6 ms a row there);
# a row whose nucleus reaches past them is sorted whole.
NUCLEUS_CANDIDATES = 4096


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[R, V]` probabilities with every token outside each row's nucleus set to 0: a token is kept
    when the tokens more probable than it hold less than `top_p` of the mass (the smallest prefix
    of the descending order whose mass reaches `top_p`, the first token always in; tokens as probable
    as the last one kept are kept too, whatever order a sort gives equal values). Row by row the same
    whatever the other rows are. On a CPU only the `NUCLEUS_CANDIDATES` most probable tokens are
    sorted (one host read: which rows need the whole sort); elsewhere every row is sorted."""
    V = probs.shape[-1]
    k = min(V, NUCLEUS_CANDIDATES) if probs.device.type == "cpu" else V
    top = probs.topk(k, -1).values  # [R, k] descending (the values, whatever the order of ties)
    kept = (top.cumsum(-1) - top) < top_p  # a prefix of each row
    last = top.gather(-1, kept.sum(-1, keepdim=True) - 1)  # [R, 1] the least probable kept value
    if k < V:
        short = kept[:, -1]  # the nucleus may reach past the candidates: sort those rows whole
        if bool(short.any()):
            rows = short.nonzero()[:, 0]
            whole = probs[rows].sort(-1, descending=True).values
            ok = (whole.cumsum(-1) - whole) < top_p
            last[rows] = whole.gather(-1, ok.sum(-1, keepdim=True) - 1)
    return probs.masked_fill(probs < last, 0.0)


def host_reads(cfg: SamplingConfig, device: torch.device, vocab: int) -> int:
    """Host reads of one `sample_tokens` call: the CPU nucleus's check, when there is a nucleus and
    more tokens than `NUCLEUS_CANDIDATES`."""
    return int(cfg.temperature > 0 and cfg.top_p < 1.0 and device.type == "cpu" and vocab > NUCLEUS_CANDIDATES)


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling with `gen` (`[V]`)."""
    return int(sample_tokens(logits[None], cfg, [gen])[0])


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `[R, V]` logits, `[R]` int64 on the device: a batched argmax when greedy,
    else temperature + nucleus probabilities for all rows at once (row-wise operations, so a row's
    are those it gets alone) and one draw per row with its own generator."""
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / cfg.temperature, -1)
    if cfg.top_p < 1.0:
        probs = nucleus(probs, cfg.top_p)
    return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)])


def sample_rows(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> list[int]:
    """`sample_tokens` read on the host."""
    return sample_tokens(logits, cfg, gens).tolist()
