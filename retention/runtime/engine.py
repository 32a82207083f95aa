"""The batched, continuously refilled decoding engine of every model: transformers models and the
reference layout models (`retention.models.arch`, DeepSeek checkpoints on the reference MLA) alike; the
model adapter (`retention.runtime.adapter`) is all that differs (the step forward, the cache, what it provides).

`S` sequence slots decode together, one token per slot per step, through one `RetentionCache` of `S`
rows. A queue of requests (one per (problem, sample)) feeds the slots: a request's prompt is prefilled
alone (batch 1, in a cache of its own, compacted by the policy as a single sequence would be), then
its stored tokens are copied into a free row of the batch. A slot whose sequence ends (EOS or length)
hands its `Generation` to `on_finish` at once and takes the next request; when the queue is empty the
finished rows are dropped from the batch.

Why the output of a sequence does not depend on its neighbours: the prefill runs alone; every decode
step attends within its own row (padding masked); the cadence and the scorer's state are per row;
sampling uses one `torch.Generator` per slot, seeded from the request's own seed when it starts.
With `S = 1` this is the single-sequence loop of `retention.runtime.generate.generate`.

With `fidelity=True` a second cache of the same rows holds the full (never compacted) cache and the
same tokens are decoded through it too (batched as well); each step records KL(p_full || p_retained)
and whether the top-1 tokens agree.

Host synchronisation: one `tolist()` of the sampled tokens per step (the batched EOS and length check;
with `fidelity` a second one for the KL figures); cache lengths and the cadence are tracked on the
host, and step timings come from CUDA events on a GPU, so nothing else waits for the device in a
decode step (a compaction step reads a few small tensors).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from retention.runtime.adapter import (LAYOUT_MODEL_PROVIDES, TRANSFORMERS_PROVIDES, ModelAdapter, cache_kwarg,  # noqa: F401
                               forward_step, provides)
from retention.runtime.cache import RetentionCache
from retention.runtime.meter import BudgetMeter
from retention.runtime.policy import RetentionPolicy
from retention.runtime.trace import CacheTrace


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
        kl, agree = step_agreement(ref_logits[None], logits[None])
        self.kl.append(kl[0])
        self.top1_agree.append(agree[0])

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


def step_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[list[float], list[bool]]:
    """KL(p_ref || p) in float64 (clamped at 0) and top-1 agreement per row of `[R, V]` logits."""
    p_log = torch.log_softmax(ref_logits.double(), -1)
    q_log = torch.log_softmax(logits.double(), -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1).clamp(min=0.0)
    agree = ref_logits.argmax(-1) == logits.argmax(-1)
    return kl.tolist(), agree.tolist()


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "eos" | "length"
    meter: BudgetMeter
    wall_seconds: float
    fidelity: Fidelity | None = None
    decode_seconds: list[float] = field(default_factory=list)  # per decode forward (of the whole batch)
    compaction_seconds: list[float] = field(default_factory=list)  # per compaction step (scoring + gather)
    step_logits: list[torch.Tensor] | None = None  # only with keep_logits=True (tests)
    trace: CacheTrace | None = None  # what the cache held (policy.tracer a CacheTracer: --trace)


@dataclass
class Request:
    """One sequence to decode: `key` comes back with its `Generation`; `seed` seeds its sampling."""

    key: object
    prompt_ids: list[int]
    seed: int = 0


@dataclass
class EngineStats:
    """Aggregate figures of one engine run (for progress bars and benchmarks)."""

    finished: int = 0
    tokens: int = 0
    busy: int = 0
    steps: int = 0
    decode_seconds: float = 0.0
    compaction_seconds: float = 0.0
    prefill_seconds: float = 0.0
    allocated_bytes: int = 0
    t_start: float = field(default_factory=time.perf_counter)

    @property
    def tokens_per_second(self) -> float:
        dt = time.perf_counter() - self.t_start
        return self.tokens / dt if dt > 0 else 0.0


@dataclass
class SequenceState:
    """One sequence in flight: its request, meter, sampler, fidelity record, tokens and timings."""

    req: Request
    meter: BudgetMeter
    gen: torch.Generator | None
    fid: Fidelity | None
    t0: float
    out: list[int] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    compact_s: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] | None = None
    finish: str | None = None
    slot: int = 0

    def stop(self, tok: int, eos: set[int], sampling: SamplingConfig) -> bool:
        """After appending `tok`: whether the sequence ends here, and why (`finish`: "eos" or "length")."""
        if tok in eos and not sampling.ignore_eos:
            self.finish = "eos"
        elif len(self.out) >= sampling.max_new_tokens:
            self.finish = "length"
        return self.finish is not None


class _Clock:
    """Step timings without a host synchronisation: CUDA events on a GPU (read once the step's
    tokens are on the host, when they are complete), the wall clock elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a


def _now(device: torch.device) -> float:
    """Wall clock after the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling with `gen` (`[V]`)."""
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


def sample_rows(logits: torch.Tensor, cfg: SamplingConfig, gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of `[R, V]` logits: a batched argmax when greedy, else each row with its own
    generator (so a row's draw never depends on the other rows)."""
    if cfg.temperature <= 0:
        return logits.argmax(-1).tolist()
    return [sample_next(logits[r], cfg, g) for r, g in enumerate(gens)]


def default_capacity(policy: RetentionPolicy, prompt_length: int, max_new_tokens: int) -> int:
    """Tokens preallocated per row: `b + N` for an evicting policy (never exceeded: a row compacts
    when it reaches it; with `protect_prompt` the prompt comes on top), else prompt + new tokens."""
    c = policy.cadence
    if policy.scorer.evicts and c.evicts:
        return c.nominal + c.span + (prompt_length if c.protect_prompt else 0)
    return prompt_length + max_new_tokens


class Engine:
    """The batched decode loop as an object: `fill()` starts up to `batch_size` requests, each `step()`
    decodes one token in every busy slot (refilling finished ones), `done` when nothing is left.
    `run_engine` drives it to the end; a benchmark can interleave several engines step by step.
    The caller holds `torch.inference_mode()`; `step()` enters the scorer's `attach` context around
    its own work only when `attach_per_step` (lockstep with other engines on the same model)."""

    def __init__(self, model, requests: Sequence[Request], policy: RetentionPolicy, sampling: SamplingConfig,
                 eos_token_ids: set[int], kib_per_token: float, *, batch_size: int = 1, fidelity: bool = False,
                 keep_logits: bool = False, on_finish: Callable[[Request, Generation], None] | None = None,
                 on_token: Callable[[int, BudgetMeter], None] | None = None):
        self.model, self.policy, self.sampling, self.eos = model, policy, sampling, set(eos_token_ids)
        self.kib, self.fidelity, self.keep_logits = kib_per_token, fidelity, keep_logits
        self.on_finish, self.on_token = on_finish, on_token
        self.device = next(model.parameters()).device
        self.adapter = ModelAdapter(model)
        self.clock = _Clock(self.device)
        self.queue = list(requests)[::-1]  # pop() from the end = first request first
        self.S = max(1, min(batch_size, len(self.queue)))
        self.stats = EngineStats(busy=self.S)
        self.rows: list[SequenceState] = []
        self.cache: RetentionCache | None = None
        self.ref: RetentionCache | None = None
        self.gens: list[torch.Generator | None] = [None] * self.S  # one per slot, reseeded per request
        policy.reset()

    @property
    def done(self) -> bool:
        return not self.rows and not self.queue

    def _start(self, slot: int):
        """Prefill the next request alone; returns its state, logits `[1, V]` and its caches."""
        req = self.queue.pop()
        dev, sampling, policy = self.device, self.sampling, self.policy
        t0 = _now(dev)
        P = len(req.prompt_ids)
        policy.reset_slot(slot, req.seed)
        if sampling.temperature > 0:
            self.gens[slot] = torch.Generator(device=dev).manual_seed(req.seed)
        st = SequenceState(req, BudgetMeter(kib_per_token=self.kib, budget=policy.cadence.budget,
                                            budget_kib=policy.budget_kib), self.gens[slot],
                   Fidelity() if self.fidelity else None, t0, logits=[] if self.keep_logits else None, slot=slot)
        tmp = self.adapter.new_cache(P, policy.scorer)
        tmp.slots, tmp.prompt_lengths = [slot], [P]
        ids = torch.tensor([req.prompt_ids], device=dev)
        pos = torch.arange(P, device=dev)[None]
        lg = self.adapter.forward(ids, pos, tmp)
        st.meter.record_prefill(tmp.stored_lengths())
        tmp_ref = None
        if self.fidelity:
            tmp_ref = self.adapter.new_cache(P + sampling.max_new_tokens)
            tmp_ref.slots, tmp_ref.prompt_lengths = [slot], [P]
            st.fid.add(self.adapter.forward(ids, pos, tmp_ref)[0], lg[0])
        t_c = _now(dev)
        self.stats.prefill_seconds += t_c - t0
        if policy.after_forward(tmp, P, st.meter, prefill=True):
            dt = _now(dev) - t_c
            st.compact_s.append(dt)
            self.stats.compaction_seconds += dt
        return st, lg, tmp, tmp_ref

    def _take(self, st: SequenceState, tok: int, row_logits: torch.Tensor) -> bool:
        """Append a sampled token; True when the sequence is finished."""
        if st.logits is not None:
            st.logits.append(row_logits.clone())
        st.out.append(tok)
        self.stats.tokens += 1
        if self.on_token is not None:
            self.on_token(len(st.out), st.meter)
        return st.stop(tok, self.eos, self.sampling)

    def _finish(self, st: SequenceState) -> None:
        g = Generation(st.out, st.finish, st.meter, _now(self.device) - st.t0, st.fid, st.decode_s, st.compact_s,
                       st.logits, self.policy.tracer.finish(st.slot, len(st.out), st.meter.steps, st.fid))
        self.stats.finished += 1
        if self.on_finish is not None:
            self.on_finish(st.req, g)

    def _admit(self, slot: int):
        """Start requests on `slot` until one survives its first token (or the queue is empty)."""
        while self.queue:
            st, lg, tmp, tmp_ref = self._start(slot)
            tok = sample_rows(self.policy.decoding.adjust(lg, [slot], [st.out]), self.sampling, [self.gens[slot]])[0]
            if self._take(st, tok, lg[0]):
                self._finish(st)
                continue
            return st, tmp, tmp_ref
        return None

    def fill(self) -> None:
        """Start the first `batch_size` requests and build the batch caches (`b + N` per row for an
        evicting policy; prompt + new tokens for `full`, grown by doubling for a longer prompt)."""
        started = []
        for slot in range(self.S):
            got = self._admit(slot)
            if got is None:
                break
            started.append(got)
        if not started:
            return
        new = self.sampling.max_new_tokens
        caps = [default_capacity(self.policy, len(st.req.prompt_ids), new) for st, _, _ in started]
        self.cache = RetentionCache.empty_like(started[0][1], len(started), max(caps))
        if self.fidelity:
            longest = max(len(st.req.prompt_ids) for st, _, _ in started)
            self.ref = RetentionCache.empty_like(started[0][2], len(started), longest + new)
            self.ref.collect_attention = False
        for r, (st, tmp, tmp_ref) in enumerate(started):
            self.cache.load_row(r, tmp)
            if self.ref is not None:
                self.ref.load_row(r, tmp_ref)
            self.rows.append(st)

    def step(self) -> None:
        """One decode step of every busy slot, then compaction of the due rows, sampling, EOS checks,
        records of finished sequences and refills."""
        rows, cache, ref, dev, stats = self.rows, self.cache, self.ref, self.device, self.stats
        if not rows:
            return
        stats.busy = R = len(rows)
        ids = torch.tensor([[st.out[-1]] for st in rows], device=dev)
        pos = torch.tensor([[len(st.req.prompt_ids) + len(st.out) - 1] for st in rows], device=dev)
        clock = self.clock
        t_step = clock.mark()
        logits = self.adapter.forward(ids, pos, cache, padded=True)
        t_fwd = clock.mark()
        stats.steps += 1
        policy = self.policy
        for r, st in enumerate(rows):
            st.meter.record([cache.lengths[r]], policy.row_kib(cache, r, self.kib))
        if ref is not None:
            ref_logits = self.adapter.forward(ids, pos, ref, padded=True)
            kl, agree = step_agreement(ref_logits, logits)
            for r, st in enumerate(rows):
                st.fid.kl.append(kl[r])
                st.fid.top1_agree.append(agree[r])
        t_c = clock.mark()
        nxt = [len(st.req.prompt_ids) + len(st.out) for st in rows]
        compacted = policy.after_forward(cache, nxt[0] if R == 1 else nxt,
                                         rows[0].meter if R == 1 else [st.meter for st in rows], prefill=False,
                                         tokens=[st.out[-1] for st in rows])
        t_end = clock.mark()
        # The one host read of the step (batched EOS and length checks); the timings after it.
        slots = cache.slots[:R]
        toks = sample_rows(policy.decoding.adjust(logits, slots, [st.out for st in rows]), self.sampling,
                           [self.gens[s] for s in slots])
        dt = clock.seconds(t_step, t_fwd)
        stats.decode_seconds += dt
        for st in rows:
            st.decode_s.append(dt)
        if compacted:
            dt = clock.seconds(t_c, t_end)
            stats.compaction_seconds += dt
            for st in rows:
                st.compact_s.append(dt)
        keep_rows = []
        for r, st in enumerate(rows):
            if not self._take(st, toks[r], logits[r]):
                keep_rows.append(r)
                continue
            self._finish(st)
            got = self._admit(cache.slots[r])
            if got is None:
                continue
            st2, tmp, tmp_ref = got
            cache.load_row(r, tmp)
            if ref is not None:
                ref.load_row(r, tmp_ref)
            rows[r] = st2
            keep_rows.append(r)
        if len(keep_rows) < R:  # the queue is empty: drop the finished rows from the batch
            self.rows = [rows[r] for r in keep_rows]
            if self.rows:
                cache.select_rows(keep_rows)
                if ref is not None:
                    ref.select_rows(keep_rows)
        stats.allocated_bytes = max(stats.allocated_bytes, cache.allocated_bytes())


def run_engine(model, requests: Sequence[Request], policy: RetentionPolicy, sampling: SamplingConfig,
               eos_token_ids: set[int], kib_per_token: float, *, batch_size: int = 1, fidelity: bool = False,
               keep_logits: bool = False, on_finish: Callable[[Request, Generation], None] | None = None,
               on_token: Callable[[int, BudgetMeter], None] | None = None,
               on_step: Callable[[EngineStats], None] | None = None) -> EngineStats:
    """Decode every request under `policy`, `batch_size` slots at a time (see module doc).

    on_finish(request, generation): called as each sequence ends, in finishing order.
    on_token(n_generated, meter): called after each token of a sequence.
    on_step(stats): called after every batched decode step.
    """
    eng = Engine(model, requests, policy, sampling, eos_token_ids, kib_per_token, batch_size=batch_size,
                 fidelity=fidelity, keep_logits=keep_logits, on_finish=on_finish, on_token=on_token)
    with torch.inference_mode(), policy.attach(model):
        eng.fill()
        while eng.rows:
            eng.step()
            if on_step is not None:
                on_step(eng.stats)
    return eng.stats
