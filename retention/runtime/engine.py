"""The batched, continuously refilled decoding engine of every model: transformers models and the
reference layout models (`retention.models.arch`, DeepSeek checkpoints on the reference MLA) alike; the
model adapter (`retention.runtime.adapter`) is all that differs (the step forward, the cache, what it provides).

`S` sequence slots decode together, one token per slot per step, through one `RetentionCache` of `S`
rows; row `r` is slot `r` (after the tail narrows, `RetentionCache.slots[r]`). A queue of requests (one per (problem, sample), drawn lazily) feeds the
slots: a request's prompt is prefilled alone (batch 1, in a cache of its own, compacted by the policy
as a single sequence would be), then its stored tokens are copied into its slot's row. With
`batch_prefill=True` (opt-in: it gives up the bfloat16 independence of a record from its neighbours,
below) the prompts that start together (the first `S`, then the slots freed by one step) are
prefilled in right-padded forwards of about a thousand tokens (`retention.runtime.prefill`; one at a
time where the scorer reads the forward itself, `Scorer.batch_prefill`), each split into a cache of
its own row. A request whose prompt repeats the one started just before it in the same refill
(samples of one problem, a benchmark's copies) starts from a copy of that forward's cache, taken before
the prefill compaction (`share_prefill`, on by default; not where the scorer reads the forward itself):
the same stored tokens a forward of its own would give. A slot whose
sequence ends (EOS or length) hands its `Generation` to `on_finish` at once and takes the next
request; when the queue is empty it stays in the batch as a padding row (one stored token, its
output discarded, never compacted, no meter), so every decode step of a run has `S` rows until the
tail narrows.

The tail (`shrink=True`, the default; `retention.runtime.tail`): once the queue is empty and at most
half the rows hold a sequence, the sequences move onto `S/2`, `S/4`, ... rows (the fewest that hold
them), but only where no record changes: the probe must find every product and the attention at
the model's shapes summing in the same order at both row counts (they are what a row count
reaches; kernels choose their order by shape alone), and the step's forward, run on the caches
narrowed to the new rows, must give every sequence bit for bit the logits (and reference logits)
of the wider step; a refusal keeps the rows. Scorers, states and decodings key per-sequence state by the engine
slot, which moves with its row. A layout model keeps its rows.

The static step (`S > 1`): every decode forward runs on all `S` rows over a static cache
(`RetentionCache.empty_like(static=True)`: views as wide as the capacity, or above 512 tokens as the
longest row rounded up to a multiple of 512, padding masked), with the token ids and positions in
`[S, 1]` buffers updated in place. No row's arithmetic then depends on who shares the batch: in
bfloat16 too, where the kernels round differently for each row count and each attended width, a
record depends on the slot count (and the capacity, fixed per run by the longest prompt it will see,
`max_prompt`) and on nothing else.

Why the output of a sequence does not depend on its neighbours: the prefill runs alone (with
`batch_prefill=True` a batched product may round a row differently in float32/bfloat16, so a record
then depends on which prompts start together: `tests/retention/test_batch_composition.py` fails with
it in bfloat16); every decode
step attends within its own row (padding masked) at a fixed width; the cadence and the scorer's state
are per row; sampling uses one `torch.Generator` per slot, seeded from the request's own seed when it
starts. With `S = 1` this is the single-sequence loop of `retention.runtime.generate.generate`, whose
cache holds exactly what transformers' `DynamicCache` holds (no padding, no mask).

With `fidelity=True` a second cache of the same rows holds the full (never compacted) cache and the
same tokens are decoded through it too (batched and static as well); each step records
KL(p_full || p_retained) and whether the top-1 tokens agree.

Host synchronisation (counted in `EngineStats.host_syncs`, `start_syncs` and `tail_syncs`): one read
per decode step, the sampled tokens (the batched EOS and length check) with the fidelity figures;
one per started sequence (its first token) and one more with fidelity (its prefill's figures); two
or three per narrowing of the tail (its comparisons). Sampling draws on the device (on a CPU the
nucleus adds one or two reads per sampling call: `retention.runtime.sampling.draw`); cache lengths
and the cadence are tracked on the host, step timings come from CUDA events on a GPU, so nothing
else waits for the device in a decode step (a compaction step reads a few small tensors).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from retention.runtime.adapter import (LAYOUT_MODEL_PROVIDES, TRANSFORMERS_PROVIDES, ModelAdapter, cache_kwarg,  # noqa: F401
                               forward_step, provides)
from retention.runtime.cache import RetentionCache, static_capacity
from retention.runtime.fidelity import Fidelity, step_agreement
from retention.runtime.host_memory import keep_large_blocks
from retention.runtime.meter import BudgetMeter
from retention.runtime.protocol import StepPolicy
from retention.runtime.prefill import chunks, full_copy, prefill_alone, prefill_batch
from retention.runtime.sampling import SamplingConfig, draw, sample_next, sample_rows, sample_tokens  # noqa: F401
from retention.runtime.sequence import EngineStats, Generation, Request, SequenceState  # noqa: F401
from retention.runtime.syncs import StepClock, synced_now
from retention.runtime.tail import TailProbe, narrow_rows, same_rows


def default_capacity(policy: StepPolicy, prompt_length: int, max_new_tokens: int) -> int:
    """Tokens preallocated per row (`StepPolicy.capacity`): `b + N` for an evicting policy (never
    exceeded: a row compacts when it reaches it; with `protect_prompt` the prompt comes on top), else
    prompt + new tokens."""
    return policy.capacity(prompt_length, max_new_tokens)


class Engine:
    """The batched decode loop as an object: `fill()` starts up to `batch_size` requests, each `step()`
    decodes one token in every slot (refilling finished ones), `done` when nothing is left.
    `run_engine` drives it to the end; a benchmark can interleave several engines step by step.
    The caller holds `torch.inference_mode()` and the scorer's `attach` context.

    batch_size: the slot count `S` of every decode step, padding rows included (not clipped to the
    number of requests: a record depends on it). max_prompt: the longest prompt the run will see,
    which sizes the rows (None: the longest of `requests`, which are then read at once).
    shrink: let the tail decode on fewer rows where that changes no record (module doc)."""

    def __init__(self, model, requests: Iterable[Request], policy: StepPolicy, sampling: SamplingConfig,
                 eos_token_ids: set[int], kib_per_token: float, *, batch_size: int = 1, fidelity: bool = False,
                 keep_logits: bool = False, on_finish: Callable[[Request, Generation], None] | None = None,
                 on_token: Callable[[int, BudgetMeter], None] | None = None, max_prompt: int | None = None,
                 shrink: bool = True, batch_prefill: bool = False, share_prefill: bool = True):
        self.model, self.policy, self.sampling, self.eos = model, policy, sampling, set(eos_token_ids)
        self.kib, self.fidelity, self.keep_logits = kib_per_token, fidelity, keep_logits
        self.on_finish, self.on_token = on_finish, on_token
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":  # a step's logits and probabilities reuse the last step's memory
            keep_large_blocks()
        self.adapter = ModelAdapter(model)
        self.clock = StepClock(self.device)
        if max_prompt is None:
            requests = list(requests)
            max_prompt = max((len(r.prompt_ids) for r in requests), default=0)
        self.max_prompt = max_prompt
        self._source = iter(requests)
        self._next = next(self._source, None)
        self.S = max(1, batch_size)
        self.R = self.S  # rows of each decode step: S, fewer once the tail narrows (`_narrow`)
        # A layout model's attention is this project's own matmul code, which the probe does not cover.
        self.shrink = shrink and self.S > 1 and not self.adapter.reference
        self._probe = TailProbe(model) if self.shrink else None
        # Opt-in: prompts that start together share a forward unless the scorer reads the forward itself.
        self.batch_prefill = batch_prefill and not self.adapter.reference and policy.batch_prefill
        # Requests with the same prompt (samples of one problem, a bench's copies) that start together share
        # one prefill forward: the copy is bit for bit what a forward of its own would store (the same
        # arithmetic on the same tokens, alone), so no record changes. Not where the scorer reads the
        # forward itself (its recorded queries are not in the cache) nor on a layout model.
        self.share_prefill = share_prefill and not self.adapter.reference and policy.batch_prefill
        self.stats = EngineStats(busy=self.S, rows=self.S)
        self.slots: list[SequenceState | None] = []  # the sequence of each slot (row); None: padding
        self.cache: RetentionCache | None = None
        self.ref: RetentionCache | None = None
        self.gens: list[torch.Generator | None] = [None] * self.S  # one per slot, reseeded per request
        self._ids = self._pos = None  # [S, 1] int64: each row's next input token and its position
        policy.reset()

    @property
    def rows(self) -> list[SequenceState]:
        """The sequences in flight, in slot order."""
        return [st for st in self.slots if st is not None]

    @property
    def done(self) -> bool:
        return self._next is None and not self.rows

    def _begin(self, slot: int) -> SequenceState:
        """Take the next request onto `slot`: its per-slot state reset, its sampler seeded."""
        req, self._next = self._next, next(self._source, None)
        self.policy.reset_slot(slot, req.seed)
        if self.sampling.temperature > 0:
            self.gens[slot] = torch.Generator(device=self.device).manual_seed(req.seed)
        return SequenceState(req, BudgetMeter(kib_per_token=self.kib, budget=self.policy.budget,
                                              budget_kib=self.policy.budget_kib), self.gens[slot],
                             Fidelity() if self.fidelity else None, synced_now(self.device),
                             logits=[] if self.keep_logits else None, slot=slot)

    def _start(self, slots: list[int]) -> list:
        """Prefill the next requests onto `slots` (as many as are queued): `(state, logits [1, V],
        cache, reference cache)` per started slot. Together, in right-padded forwards of about a
        thousand tokens (`retention.runtime.prefill`), where the scorer allows it; else each alone,
        its prefill compaction before the next prompt's forward (a scorer's recorded queries)."""
        n = len(slots)
        if self._next is None or n == 0:
            return []
        if n == 1 or not self.batch_prefill:
            out, kept = [], None  # kept: (prompt, logits, pristine cache) of the last forward, for the next request
            while self._next is not None and len(out) < n:
                st = self._begin(slots[len(out)])
                prompt = st.req.prompt_ids
                if kept is not None and kept[0] == prompt:  # the same prompt again: its forward's copy
                    lg, tmp = kept[1].clone(), kept[2].take_rows([0])
                    self.stats.shared_prefills += 1
                else:
                    lg, tmp = prefill_alone(self.adapter, prompt, st.slot, self.policy, self.device)
                    self.stats.prefill_batches += 1
                # Copy before the prefill compaction, only when the next queued request repeats this prompt.
                nxt = self._next
                kept = (prompt, lg.clone(), tmp.take_rows([0])) if (self.share_prefill and nxt is not None
                                                            and len(out) + 1 < n and nxt.prompt_ids == prompt) else None
                out.append(self._prefilled(st, lg, tmp, st.t0))
            return out
        states = []
        while self._next is not None and len(states) < n:
            states.append(self._begin(slots[len(states)]))
        t0 = states[0].t0
        prompts = [st.req.prompt_ids for st in states]
        logits, caches = [None] * len(states), [None] * len(states)
        for grp in chunks([len(p) for p in prompts]):
            lg, cs = prefill_batch(self.adapter, [prompts[i] for i in grp], self.policy, self.device)
            for j, i in enumerate(grp):
                logits[i], caches[i] = lg[j:j + 1], cs[j]  # [1, V], a single-row cache
            self.stats.prefill_batches += 1
        return [self._prefilled(st, lg, tmp, t0 if i == 0 else None)
                for i, (st, lg, tmp) in enumerate(zip(states, logits, caches))]

    def _prefilled(self, st: SequenceState, lg: torch.Tensor, tmp: RetentionCache, t0: float | None):
        """After a sequence's prefill: its meter, reference copy and prefill compaction, as alone
        (`t0`: when the prefill forward began, counted in `prefill_seconds`; None: counted already)."""
        dev, policy, P = self.device, self.policy, len(st.req.prompt_ids)
        tmp.slots, tmp.prompt_lengths = [st.slot], [P]
        st.meter.record_prefill(tmp.stored_lengths())
        tmp_ref = None
        if self.fidelity:  # the full cache of the prompt is what the prefill just stored: a copy, before
            tmp_ref = full_copy(tmp, P + self.sampling.max_new_tokens)  # any compaction (its forward is this one)
            st.fid.add(lg[0], lg[0])
            self.stats.start_syncs += 1
        t_c = synced_now(dev)
        if t0 is not None:
            self.stats.prefill_seconds += t_c - t0
        if policy.after_forward(tmp, P, st.meter, prefill=True):
            dt = synced_now(dev) - t_c
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
        g = Generation(st.out, st.finish, st.meter, synced_now(self.device) - st.t0, st.fid, st.decode_s, st.compact_s,
                       st.logits, self.policy.finish(st.slot, len(st.out), st.meter.steps, st.fid))
        self.stats.finished += 1
        if self.on_finish is not None:
            self.on_finish(st.req, g)

    def _admit(self, slots: list[int]) -> list:
        """Start requests on `slots` until each holds one that survives its first token (or the queue
        is empty): per slot, `(state, cache, reference cache)` or None (padding)."""
        got: dict[int, tuple] = {}
        pending = list(slots)
        t0 = synced_now(self.device)
        while pending and self._next is not None:
            started = self._start(pending)
            retry = []
            for st, lg, tmp, tmp_ref in started:
                toks, reads = draw(self.policy.adjust(lg, [st.slot], [st.out]), self.sampling, [st.gen])
                self.stats.start_syncs += 1 + reads
                if self._take(st, toks.tolist()[0], lg[0]):
                    self._finish(st)
                    retry.append(st.slot)
                else:
                    got[st.slot] = (st, tmp, tmp_ref)
            pending = retry + pending[len(started):]
        self.stats.start_seconds += synced_now(self.device) - t0
        return [got.get(slot) for slot in slots]

    def _load(self, slot: int, got) -> None:
        """Put a started sequence `(state, cache, reference cache)` into `slot`; None: padding."""
        if got is None:
            self.slots[slot] = None
            return
        st, tmp, tmp_ref = got
        self.cache.load_row(slot, tmp)
        if self.ref is not None:
            self.ref.load_row(slot, tmp_ref)
        self.slots[slot] = st
        self._ids[slot, 0] = st.out[-1]
        self._pos[slot, 0] = len(st.req.prompt_ids) + len(st.out) - 1

    def fill(self) -> None:
        """Start the first `batch_size` requests and build the batch caches: `S` rows of
        `default_capacity` at the run's longest prompt (`b + N` for an evicting policy; prompt + new
        tokens for `full`), static when `S > 1`; slots left without a request are padding."""
        started = self._admit(list(range(self.S)))
        first = next((got for got in started if got is not None), None)
        if first is None:
            return
        new, static = self.sampling.max_new_tokens, self.S > 1
        size = static_capacity if static else int
        cap = size(default_capacity(self.policy, self.max_prompt, new))
        self.cache = RetentionCache.empty_like(first[1], self.S, cap, static=static)
        if self.fidelity:  # never narrower than the retained cache: views of one width reduce alike, so a
            # budget beyond the run's length reproduces the reference exactly, whatever the kernels' blocking
            ref_cap = max(cap, size(self.max_prompt + new))
            self.ref = RetentionCache.empty_like(first[2], self.S, ref_cap, static=static)
            self.ref.collect_attention = False
        self._ids = torch.zeros(self.S, 1, dtype=torch.long, device=self.device)
        self._pos = torch.zeros(self.S, 1, dtype=torch.long, device=self.device)
        self.slots = [None] * self.S
        for slot, got in enumerate(started):
            self._load(slot, got)
        self._release_padding()

    def _release_padding(self) -> None:
        for slot, st in enumerate(self.slots):
            if st is None:
                self.cache.release_row(slot)
                if self.ref is not None:
                    self.ref.release_row(slot)

    def step(self) -> None:
        """One decode step of every row, then compaction of the due rows, sampling, EOS checks,
        records of finished sequences and refills (or padding)."""
        act = [r for r, st in enumerate(self.slots) if st is not None]
        if not act:
            return
        stats, clock, policy = self.stats, self.clock, self.policy
        trial, copies = self._tail_rows(act), None
        if trial is not None:
            t0 = synced_now(self.device)
            copies = self.cache.take_rows(trial), None if self.ref is None else self.ref.take_rows(trial)
            stats.tail_seconds += synced_now(self.device) - t0
        t_step = clock.mark()
        logits = self.adapter.forward(self._ids, self._pos, self.cache, padded=True)  # [R, V]
        t_fwd = clock.mark()
        stats.steps += 1
        widths = self.cache.widths  # lengths + holes: the buffer slots each row occupies per (layer, KV head)
        for r in act:
            self.slots[r].meter.record([self.cache.lengths[r]], policy.row_kib(self.cache, r, self.kib), widths[r])
        ref_logits = None if self.ref is None else self.adapter.forward(self._ids, self._pos, self.ref, padded=True)
        t_ref = clock.mark()
        if copies is not None:
            got = self._narrow(trial, copies, act, logits, ref_logits)
            if got is not None:
                logits, ref_logits = got
                act = [r for r, st in enumerate(self.slots) if st is not None]
        t_narrow = clock.mark()
        slots, cache, ref = self.slots, self.cache, self.ref
        stats.busy = len(act)
        stats.padding_rows += self.R - len(act)
        whole = len(act) == self.R
        idx = None if whole else torch.tensor(act, device=self.device)
        sub = logits if whole else logits.index_select(0, idx)  # [A, V]: the rows holding a sequence
        fid = None
        if ref is not None:
            fid = step_agreement(ref_logits if whole else ref_logits.index_select(0, idx), sub)
        t_c = clock.mark()
        nxt = [len(st.req.prompt_ids) + len(st.out) if st else 1 for st in slots]
        meters = [st.meter if st else None for st in slots]
        compacted = policy.after_forward(cache, nxt[0] if self.S == 1 else nxt, meters[0] if self.S == 1 else meters,
                                         prefill=False, tokens=[st.out[-1] if st else None for st in slots])
        t_end = clock.mark()
        toks, reads = draw(policy.adjust(sub, [slots[r].slot for r in act], [slots[r].out for r in act]),
                           self.sampling, [slots[r].gen for r in act])
        # The one host read of the step: the tokens (batched EOS and length checks), the fidelity figures.
        A = len(act)
        read = (toks.tolist() if fid is None else torch.cat([toks.double(), fid[0], fid[1].double()]).tolist())
        stats.host_syncs += 1 + reads
        if whole:
            self._ids.copy_(toks[:, None])
        else:
            self._ids.index_copy_(0, idx, toks[:, None])
        self._pos += 1
        dt = clock.seconds(t_step, t_fwd)
        stats.decode_seconds += dt
        if ref is not None:
            stats.fidelity_seconds += clock.seconds(t_fwd, t_ref) + clock.seconds(t_narrow, t_c)
        if copies is not None:
            stats.tail_seconds += clock.seconds(t_ref, t_narrow)
        dt_c = clock.seconds(t_c, t_end) if compacted else None
        if dt_c is not None:
            stats.compaction_seconds += dt_c
        ended = []
        for i, r in enumerate(act):
            st = slots[r]
            st.decode_s.append(dt)
            if dt_c is not None:
                st.compact_s.append(dt_c)
            if fid is not None:
                st.fid.kl.append(read[A + i])
                st.fid.top1_agree.append(bool(read[2 * A + i]))
            if self._take(st, int(read[i]), logits[r]):
                self._finish(st)
                ended.append(r)
        for r, got in zip(ended, self._admit(ended)):  # the freed slots start together
            self._load(r, got)
        self._release_padding()
        stats.allocated_bytes = max(stats.allocated_bytes, cache.allocated_bytes())

    def _tail_rows(self, act: list[int]) -> list[int] | None:
        """The rows the tail decodes on from this step (`tail.narrow_rows`), or None to keep `R`
        (also when the probe finds that a product or the attention would sum in another order there)."""
        if not self.shrink or self._next is not None:
            return None
        rows = narrow_rows([st is not None for st in self.slots])
        if rows is None:
            return None
        t0 = synced_now(self.device)
        views = [(c.reachable_widths(), c.layers[0].capacity, c.ragged) for c in (self.cache, self.ref) if c is not None]
        exact = self._probe.exact(self.R, rows, act, views)
        self.stats.tail_seconds += synced_now(self.device) - t0
        self.stats.tail_syncs += 1
        return rows if exact else self._refuse()

    def _narrow(self, rows: list[int], copies, act: list[int], logits: torch.Tensor, ref_logits):
        """Decode this step on `copies` (the caches narrowed to `rows`, before the step's write) and
        take them over if every sequence's logits (and reference logits) are bit for bit those of
        the `R` rows: the narrow `(logits, reference logits)`, or None (the rows are kept)."""
        ridx = torch.tensor(rows, device=self.device)
        ids, pos = self._ids.index_select(0, ridx), self._pos.index_select(0, ridx)
        wide = (logits, ref_logits)
        got = same_rows(lambda c: self.adapter.forward(ids, pos, c, padded=True), copies, wide, act, self.stats)
        if got is None:
            return self._refuse()
        self.cache, self.ref, self._ids, self._pos = *copies, ids, pos
        self.slots = [self.slots[r] for r in rows]
        self.R = self.stats.rows = len(rows)
        self.stats.narrowed += 1
        return got

    def _refuse(self) -> None:
        self.shrink, self._probe = False, None  # the probe's weights are freed with it
        self.stats.narrow_refused += 1


def run_engine(model, requests: Iterable[Request], policy: StepPolicy, sampling: SamplingConfig,
               eos_token_ids: set[int], kib_per_token: float, *, batch_size: int = 1, fidelity: bool = False,
               keep_logits: bool = False, on_finish: Callable[[Request, Generation], None] | None = None,
               on_token: Callable[[int, BudgetMeter], None] | None = None,
               on_step: Callable[[EngineStats], None] | None = None, max_prompt: int | None = None,
               shrink: bool = True, batch_prefill: bool = False, share_prefill: bool = True) -> EngineStats:
    """Decode every request under `policy` in `batch_size` slots (see module doc).

    on_finish(request, generation): called as each sequence ends, in finishing order.
    on_token(n_generated, meter): called after each token of a sequence.
    on_step(stats): called after every batched decode step.
    """
    eng = Engine(model, requests, policy, sampling, eos_token_ids, kib_per_token, batch_size=batch_size,
                 fidelity=fidelity, keep_logits=keep_logits, on_finish=on_finish, on_token=on_token,
                 max_prompt=max_prompt, shrink=shrink, batch_prefill=batch_prefill, share_prefill=share_prefill)
    with torch.inference_mode(), policy.attach(model):
        eng.fill()
        while eng.rows:
            eng.step()
            if on_step is not None:
                on_step(eng.stats)
    return eng.stats
