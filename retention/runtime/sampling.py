"""Sampling the next token of each row: greedy (a batched argmax) or temperature + nucleus (top-p)
sampling with one `torch.Generator` per row, so that a row's draw never depends on the other rows.
Tokens stay on the device (`sample_tokens`): the engine reads them on the host once per step.

The nucleus keeps every token as probable as the last one the prefix rule keeps, so it does not
depend on how a sort orders equal probabilities (frequent in bfloat16 logits). Earlier versions
kept an arbitrary part of such a tie at the boundary (the order of an unstable sort of the whole
vocabulary); a sampled record differs from theirs only where that happened.

Two samplers draw from the same nucleus distribution (`SamplingConfig.sampler`, the run
configuration's `sampler` key; a configuration without it was drawn by `multinomial`):

* `inverse-cdf` (the default of new runs): one uniform number per row from the row's generator,
  and the token at which the nucleus's cumulative mass, in token-id order, first exceeds it
  (`inverse_cdf`). On a CPU only the `DRAW_CANDIDATES` most probable tokens are looked at.
* `multinomial`: `torch.multinomial` per row, which draws one exponential number per vocabulary
  entry (3 ms a row for Qwen2.5's 151,936 tokens here, 195 ms of a 64-row step against about 160 ms
  for the model's forward). It is what every sampled record before the `sampler` key was drawn
  with, so `retention reproduce` still reproduces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# The samplers of sampled runs; a run configuration without a `sampler` key means LEGACY_SAMPLER.
SAMPLERS = ("inverse-cdf", "multinomial")
LEGACY_SAMPLER = "multinomial"
DEFAULT_SAMPLER = "inverse-cdf"  # of new runs


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    sampler: str = DEFAULT_SAMPLER  # or LEGACY_SAMPLER (see the module doc)

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")


# Candidates a CPU sorts for the nucleus (a full sort of a 49k-151k vocabulary costs 2-6 ms a row there);
# a row whose nucleus reaches past them is sorted whole.
NUCLEUS_CANDIDATES = 4096
# Candidates the inverse-CDF draw looks at on a CPU (a top-256 of a [64, 151936] float tensor takes
# 12 ms here, a top-4096 42 ms); a row whose nucleus may reach past them is drawn from its whole row.
DRAW_CANDIDATES = 256


def _least_kept(desc: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix rule over `[r, k]` probabilities in descending order: `[r, k]` bool, the tokens
    kept (those the more probable ones before them leave under `top_p` of the mass: a prefix, the
    first always in), and `[r, 1]` the least probable kept value."""
    kept = (desc.cumsum(-1) - desc) < top_p
    return kept, desc.gather(-1, kept.sum(-1, keepdim=True) - 1)


def _least_kept_whole(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_least_kept`'s `[r, 1]` value over whole `[r, V]` rows (sorted whole: the slow path on a CPU)."""
    return _least_kept(probs.sort(-1, descending=True).values, top_p)[1]


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
    kept, last = _least_kept(top, top_p)  # [R, k] a prefix of each row, [R, 1]
    if k < V:
        short = kept[:, -1]  # the nucleus may reach past the candidates: sort those rows whole
        if bool(short.any()):
            rows = short.nonzero()[:, 0]
            last[rows] = _least_kept_whole(probs[rows], top_p)
    return probs.masked_fill(probs < last, 0.0)


def inverse_cdf(probs: torch.Tensor, top_p: float, u: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One token per row of `[R, V]` probabilities (`[R]` int64) and the host reads made: the nucleus (as `nucleus` keeps it;
    every token with a positive probability when `top_p >= 1`) in token-id order, and the first
    token at which its cumulative mass (float64) exceeds `u` (`[R]` float64 in [0, 1)) times its
    total. A function of the row's probabilities and its `u` alone: no sort order of equal values
    enters. On a CPU a row is drawn from its `DRAW_CANDIDATES` most probable tokens when its nucleus
    lies among them (then `NUCLEUS_CANDIDATES`, then the whole row; one host read per widening), with
    the partial sums the whole row gives (the tokens left out add exact zeros)."""
    R, V = probs.shape
    if top_p >= 1.0:
        return _draw_whole(probs, probs > 0, u), 0
    tiers = [k for k in (DRAW_CANDIDATES, NUCLEUS_CANDIDATES) if k < V] if probs.device.type == "cpu" else []
    tok = torch.empty(R, dtype=torch.long, device=probs.device)
    rows = None  # the rows not drawn yet (None: all)
    reads = 0
    for k in tiers:
        p, w = (probs, u) if rows is None else (probs[rows], u[rows])
        vals, idx = p.topk(k, -1)  # [r, k] descending
        last = _least_kept(vals, top_p)[1]  # [r, 1]
        ids = idx.masked_fill(vals < last, V).sort(-1).values  # [r, k] kept token ids ascending, then V
        inside = ids < V
        c = p.gather(-1, ids.clamp_max(V - 1)).masked_fill(~inside, 0.0).double().cumsum(-1)  # [r, k]
        j = torch.searchsorted(c, (w * c[:, -1])[:, None], right=True)  # [r, 1]
        got = ids.gather(-1, torch.minimum(j, inside.sum(-1, keepdim=True) - 1))[:, 0]
        # {p >= last} lies among the candidates unless the k-th candidate is as probable as `last`.
        short = vals[:, -1] >= last[:, 0]
        if rows is None:
            tok = got
        else:
            tok[rows] = got
        reads += 1
        if not bool(short.any()):
            return tok, reads
        rows = short.nonzero()[:, 0] if rows is None else rows[short]
    p, w = (probs, u) if rows is None else (probs[rows], u[rows])
    got = _draw_whole(p, p >= _least_kept_whole(p, top_p), w)
    if rows is None:
        return got, reads
    tok[rows] = got
    return tok, reads


def _draw_whole(probs: torch.Tensor, mask: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`inverse_cdf` over whole rows: `[R, V]` probabilities, `[R, V]` bool nucleus, `[R]` uniforms."""
    c = probs.masked_fill(~mask, 0.0).double().cumsum(-1)  # [R, V]
    j = torch.searchsorted(c, (u * c[:, -1])[:, None], right=True)
    last = (mask * torch.arange(1, probs.shape[-1] + 1, device=probs.device)).amax(-1, keepdim=True) - 1
    return torch.minimum(j, last)[:, 0]  # u * total rounded up to the total: the last kept token


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, `[..., V]` -> `[...]` int64: the first maximum (NaN counts as the
    largest), through `max`, whose indices follow the same rule: on a CPU `argmax` over bfloat16 ran
    4x slower (17.5 against 4.2 ms for `[64, 151936]`, 6% of a qwen2.5-coder-0.5b step:
    `results/packed-linears/probes/argmax_speed.log`)."""
    return logits.max(-1).indices


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling with `gen` (`[V]`)."""
    return int(sample_tokens(logits[None], cfg, [gen])[0])


def draw(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> tuple[torch.Tensor, int]:
    """One token per row of `[R, V]` logits, `[R]` int64 on the device, and the host reads the draw
    made (on a CPU the nucleus's candidates are checked on the host: at most one read for
    `multinomial`, two for `inverse-cdf`; none elsewhere and none when greedy). A batched argmax when
    greedy, else temperature + nucleus probabilities for all rows at once (row-wise operations, so a
    row's are those it gets alone) and one draw per row with its own generator (`cfg.sampler`)."""
    if cfg.temperature <= 0:
        return greedy(logits), 0
    probs = torch.softmax(logits.float() / cfg.temperature, -1)
    if cfg.sampler == "inverse-cdf":
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64, device=probs.device) for g in gens])
        return inverse_cdf(probs, cfg.top_p, u)
    reads = 0
    if cfg.top_p < 1.0:
        reads = int(probs.device.type == "cpu" and probs.shape[-1] > NUCLEUS_CANDIDATES)
        probs = nucleus(probs, cfg.top_p)
    return torch.cat([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(gens)]), reads


def sample_tokens(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> torch.Tensor:
    """`draw`'s tokens."""
    return draw(logits, cfg, gens)[0]


def sample_rows(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> list[int]:
    """`sample_tokens` read on the host."""
    return sample_tokens(logits, cfg, gens).tolist()
