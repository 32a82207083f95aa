"""`retention run` on the reference modules (`ArchLM`, or a DeepSeek checkpoint on the reference
MLA: `retention.arch.deepseek`): batched, continuously refilled decoding under retention.

The same contract as `retention.engine.run_engine` (requests in, one `Generation` per request to
`on_finish` as it ends, the same `BudgetMeter` and `Fidelity` records). `S` rows decode together,
one token per row per step, through one `LayoutCache`: a request's prompt is prefilled alone (its
own one-row cache and scorer state, compacted by the cadence as a single sequence would be), then
loaded into a free row; a finished row takes the next request at once, and when the queue is empty
finished rows leave the batch. Rows hold different numbers of tokens; the unused slots are padding
at a position no query reaches (`retention.arch.cache.PAD`).

Why a record does not depend on the batch: the prefill runs alone; attention is per row and never
sees padding; the cadence is per row (a row compacts when its own real tokens reach `b + N`) and
its kept set is chosen on its real tokens alone (`GroupScorer.keep_row`); sampling uses one
generator per row, seeded by the request's seed (`retention.engine`'s sampler: greedy at
temperature 0, else temperature + top-p). The meter records, per row and step, the real tokens
the step attended to. With `fidelity`, a second, never compacted cache of the same rows decodes
the same tokens and each forward records KL(p_full || p_retained) and top-1 agreement.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from retention.arch import retention as arch_retention
from retention.arch.cache import LayoutCache
from retention.arch.model import LayoutLM
from retention.cadence import Cadence
from retention.engine import (
    Fidelity,
    Generation,
    Request,
    SamplingConfig,
    SequenceState,
    sample_next,
    step_agreement,
)
from retention.meter import BudgetMeter

# Scorer parameters a layout cache takes (the rest of a harness scorer's are refused by validation).
PARAMS = ("window", "kernel")


def _forward(model: LayoutLM, ids: list[int], start: int, cache) -> torch.Tensor:
    """Forward one sequence's `ids` at positions `start...`; the next-token logits `[1, V]`."""
    dev = model.device
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    return model(torch.tensor([ids], device=dev), pos, cache, logits_to_keep=1).logits[:, -1]


def _prompt_length(row: SequenceState) -> int:
    return len(row.req.prompt_ids)


def _next_position(row: SequenceState) -> int:
    """The absolute position of the token the row feeds next (its last sampled one)."""
    return len(row.req.prompt_ids) + len(row.out) - 1


class ArchEngine:
    """The batched loop: `run()` decodes every request, `batch_size` rows at a time (module doc)."""

    def __init__(self, model: LayoutLM, requests: Sequence[Request], scorer: str, params: dict, cadence: Cadence,
                 sampling: SamplingConfig, eos_ids: set[int], kib_per_token: float, *, batch_size: int = 1,
                 fidelity: bool = False, on_finish: Callable[[Request, Generation], None] | None = None,
                 on_step: Callable[[object, list[BudgetMeter]], None] | None = None):
        self.model, self.cadence, self.sampling, self.eos = model, cadence, sampling, set(eos_ids)
        self.kib, self.fidelity, self.on_finish, self.on_step = kib_per_token, fidelity, on_finish, on_step
        self.scorer_args = (scorer, {k: v for k, v in params.items() if k in PARAMS})
        self.evicts = arch_retention.GroupScorer(scorer, **self.scorer_args[1]).evicts and cadence.evicts
        self.queue = list(requests)[::-1]  # pop() from the end = first request first
        self.S = max(1, min(batch_size, len(self.queue)))
        self.rows: list[SequenceState] = []
        self.cache = self.ref = self.scorer = None

    def _capacity(self, prompt_length: int) -> int:
        """Tokens a row's buffers hold: `b + N` under a budget (never exceeded between compactions)."""
        full = prompt_length + self.sampling.max_new_tokens
        return self.cadence.keep(prompt_length) + self.cadence.interval if self.evicts else full

    def _start(self):
        """Prefill the next request alone: its row, first logits `[1, V]`, one-row cache, scorer, reference."""
        req = self.queue.pop()
        P = len(req.prompt_ids)
        gen = None
        if self.sampling.temperature > 0:
            gen = torch.Generator(device=self.model.device).manual_seed(req.seed)
        row = SequenceState(req, BudgetMeter(kib_per_token=self.kib, budget=self.cadence.budget), gen,
                            Fidelity() if self.fidelity else None, time.perf_counter())
        name, params = self.scorer_args
        scorer = arch_retention.GroupScorer(name, seed=req.seed, **params)
        cache = self.model.new_cache(self._capacity(P))
        scorer.attach(cache)
        logits = _forward(self.model, req.prompt_ids, 0, cache)
        row.meter.record_prefill(cache.row_lengths())
        ref = None
        if self.fidelity:
            ref = self.model.new_cache(P + self.sampling.max_new_tokens)
            row.fid.add(_forward(self.model, req.prompt_ids, 0, ref)[0], logits[0])
        if self.evicts and self.cadence.due(P, True, P):
            t = time.perf_counter()
            arch_retention.compact(cache, scorer, self.cadence, [0], [P], [P])
            row.compact_s.append(time.perf_counter() - t)
            row.meter.note_compaction(cache.row_lengths())
        return row, logits, cache, scorer, ref

    def _take(self, row: SequenceState, tok: int) -> bool:
        """Append a sampled token; True when the sequence is finished (its `finish` reason set)."""
        row.out.append(tok)
        return row.stop(tok, self.eos, self.sampling)

    def _finish(self, row: SequenceState) -> None:
        g = Generation(row.out, row.finish, row.meter, time.perf_counter() - row.t0, row.fid, row.decode_s,
                       row.compact_s)
        if self.on_finish is not None:
            self.on_finish(row.req, g)

    def _admit(self):
        """Start requests until one survives its first token (None when the queue is empty)."""
        while self.queue:
            row, logits, cache, scorer, ref = self._start()
            if self._take(row, sample_next(logits[0], self.sampling, row.gen)):
                self._finish(row)
                continue
            return row, cache, scorer, ref
        return None

    def _fill(self) -> None:
        started = [got for got in (self._admit() for _ in range(self.S)) if got is not None]
        if not started:
            return
        self.rows = [row for row, *_ in started]
        cap = max(self._capacity(_prompt_length(row)) for row in self.rows)
        self.cache = LayoutCache.stack([c for _, c, _, _ in started], cap)
        self.scorer = arch_retention.GroupScorer.stack([s for *_, s, _ in started], self.cache.positions[0].shape[-1])
        self.scorer.observe(self.cache)
        if self.fidelity:
            self.ref = LayoutCache.stack([ref for *_, ref in started],
                                         max(_prompt_length(row) for row in self.rows) + self.sampling.max_new_tokens)

    def _step(self) -> None:
        """One decode step of every row, the due rows' compaction, sampling, finishes and refills."""
        rows, cache, dev = self.rows, self.cache, self.model.device
        ids = torch.tensor([[row.out[-1]] for row in rows], device=dev)
        pos = torch.tensor([[_next_position(row)] for row in rows], device=dev)
        t = time.perf_counter()
        logits = self.model(ids, pos, cache, logits_to_keep=1).logits[:, -1]
        dt = time.perf_counter() - t
        lengths = cache.row_lengths()
        for row, n in zip(rows, lengths, strict=True):
            row.meter.record([n])
            row.decode_s.append(dt)
        if self.ref is not None:
            ref_logits = self.model(ids, pos, self.ref, logits_to_keep=1).logits[:, -1]
            kl, agree = step_agreement(ref_logits, logits)
            for r, row in enumerate(rows):
                row.fid.kl.append(kl[r])
                row.fid.top1_agree.append(agree[r])
        nxt = [_next_position(row) + 1 for row in rows]
        due = [r for r, row in enumerate(rows)
               if self.evicts and self.cadence.due(lengths[r], False, _prompt_length(row))]
        if due:
            t = time.perf_counter()
            arch_retention.compact(cache, self.scorer, self.cadence, due, nxt, [_prompt_length(row) for row in rows])
            dt = time.perf_counter() - t
            lengths = cache.row_lengths()
            for r in due:
                rows[r].compact_s.append(dt)
                rows[r].meter.note_compaction([lengths[r]])
        if self.on_step is not None:
            self.on_step(cache, [row.meter for row in rows])
        toks = [sample_next(logits[r], self.sampling, row.gen) for r, row in enumerate(rows)]
        keep = []
        for r, row in enumerate(rows):
            if not self._take(row, toks[r]):
                keep.append(r)
                continue
            self._finish(row)
            got = self._admit()
            if got is None:
                continue
            rows[r], one, scorer, ref = got
            cache.load_row(r, one)
            self.scorer.load_row(r, scorer, cache.positions[0].shape[-1])
            if self.ref is not None:
                self.ref.load_row(r, ref)
            keep.append(r)
        if len(keep) < len(rows):  # the queue is empty: finished rows leave the batch
            self.rows = [rows[r] for r in keep]
            if self.rows:
                for state in (cache, self.scorer, self.ref):
                    if state is not None:
                        state.select_rows(keep)

    @torch.no_grad()
    def run(self) -> None:
        self._fill()
        while self.rows:
            self._step()


def generate_one(model: LayoutLM, request: Request, scorer: str, params: dict, cadence: Cadence,
                 sampling: SamplingConfig, eos_ids: set[int], kib_per_token: float, *, fidelity: bool = False,
                 on_step: Callable[[object, BudgetMeter], None] | None = None) -> Generation:
    """Decode one request (the engine at one row). on_step(cache, meter): after every decode step's
    compaction (tests read the cache)."""
    done = []
    engine = ArchEngine(model, [request], scorer, params, cadence, sampling, eos_ids, kib_per_token,
                        fidelity=fidelity, on_finish=lambda req, g: done.append(g),
                        on_step=None if on_step is None else (lambda cache, meters: on_step(cache, meters[0])))
    engine.run()
    return done[0]


def run_arch(model: LayoutLM, requests: Sequence[Request], scorer: str, params: dict, cadence: Cadence,
             sampling: SamplingConfig, eos_ids: set[int], kib_per_token: float, *, batch_size: int = 1,
             fidelity: bool = False, on_finish: Callable[[Request, Generation], None] | None = None) -> None:
    """Decode every request, `batch_size` rows at a time; `on_finish(request, generation)` as each ends."""
    ArchEngine(model, requests, scorer, params, cadence, sampling, eos_ids, kib_per_token, batch_size=batch_size,
               fidelity=fidelity, on_finish=on_finish).run()
