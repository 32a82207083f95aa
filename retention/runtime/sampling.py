"""Sampling the next token of each row: greedy (a batched argmax) or temperature + nucleus (top-p)
sampling with one `torch.Generator` per row, so that a row's draw never depends on the other rows.
Tokens stay on the device (`sample_tokens`): the engine reads them on the host once per step.
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


def _draw(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """One token `[1]` of `[V]` logits on the device: temperature + nucleus (top-p) sampling with `gen`."""
    probs = torch.softmax(logits.float() / cfg.temperature, -1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= cfg.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen)


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling with `gen` (`[V]`)."""
    return int(logits.argmax()) if cfg.temperature <= 0 else int(_draw(logits, cfg, gen))


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `[R, V]` logits, `[R]` int64 on the device: a batched argmax when greedy,
    else each row with its own generator (so a row's draw never depends on the other rows)."""
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    return torch.cat([_draw(logits[r], cfg, g) for r, g in enumerate(gens)])


def sample_rows(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> list[int]:
    """`sample_tokens` read on the host."""
    return sample_tokens(logits, cfg, gens).tolist()
