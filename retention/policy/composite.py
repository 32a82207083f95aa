"""A retention policy = five mechanisms, one per intervention family of the design space:

    scoring   which tokens are kept                 `Scorer.score` / `select`   (policy.scoring)
    cadence   when a compaction happens             `Cadence.due`, the bound on b (policy.cadence)
    routing   which kept set each layer follows,    `Routing.configure/keep`    (policy.routing)
              and how many (an allocation)
    state     what a kept token is stored as        `State.before/after_compaction`, `row_kib`
    decoding  how generation behaves on the cache   `Decoding.adjust` on each step's logits

It is what the runtime's engine runs (`retention.runtime.protocol.StepPolicy`, which it implements).
The generation loop calls `after_forward` after each forward (the scorer observes, the cadence
says which rows are due, the routing selects with the scorer's scores, the state acts around the
gather), `adjust` on the logits before sampling, `row_kib` for the meter and `reset_slot` when a slot
starts a sequence. The defaults (`fixed`, `native`, `full`, `none`) are today's behaviour bit for bit.

The policy also holds the run's tracer (`tracer`, `retention.runtime.trace`): the default `NullTracer`
records nothing; a `--trace` run's `CacheTracer` is told of each prefill and each compaction here, and
the engine asks it for the sequence's trace when the sequence ends.

The cadence is per row (sequence slot): after a forward, every row whose own stored length reached
`b + N` (or its prompt exceeded `b`, at prefill) is due, and the scorer runs once over all the rows due
at that step (one `CacheView`, vectorised over them). Rows that keep different numbers of tokens (only
with `protect_prompt`, where the prompt is kept on top of `b`) are compacted in groups of equal size.
An allocating routing (PyramidKV, AdaKV) splits each row's `L x G x k` kept tokens unevenly over
its layers and heads; the row's mean stays `k` (`retention.policy.routing`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from retention.policy.cadence.base import Cadence, default_interval, nominal_budget
from retention.policy.decoding.base import Decoding
from retention.policy.routing.base import Routing
from retention.policy.scoring.base import Scorer
from retention.policy.state.base import State
from retention.runtime.cache import RetentionCache
from retention.runtime.meter import BudgetMeter
from retention.runtime.trace import CacheTrace, NullTracer


@dataclass
class RetentionPolicy:
    scorer: Scorer
    cadence: Cadence
    routing: Routing = field(default_factory=Routing)
    state: State = field(default_factory=State)
    decoding: Decoding = field(default_factory=Decoding)
    budget_kib: float | None = None  # --budget-bytes: the meter holds the mean KiB to it too
    tracer: NullTracer = field(default_factory=NullTracer)  # --trace: a CacheTracer

    def __post_init__(self):
        self.scorer = self.routing.configure(self.scorer)

    # ------------------------------------------------- what the engine asks (`retention.runtime.protocol`)

    @property
    def budget(self) -> int | None:
        """The token budget the meters hold: the cadence's."""
        return self.cadence.budget

    @property
    def batch_prefill(self) -> bool:
        return self.scorer.batch_prefill

    def reading(self) -> tuple[frozenset[str], ...]:
        return self.scorer.reading()

    def capacity(self, prompt_length: int, max_new_tokens: int) -> int:
        """`b + N` for an evicting policy (never exceeded: a row compacts when it reaches it; with
        `protect_prompt` the prompt comes on top), else prompt + new tokens."""
        c = self.cadence
        if self.scorer.evicts and c.evicts:
            return c.nominal + c.span + (prompt_length if c.protect_prompt else 0)
        return prompt_length + max_new_tokens

    def adjust(self, logits: torch.Tensor, slots: list[int], histories: list[list[int]]) -> torch.Tensor:
        """The decoding's adjustment of the logits `[R, V]` before sampling."""
        return self.decoding.adjust(logits, slots, histories)

    def finish(self, slot: int, output_tokens: int, steps: int, fidelity=None) -> CacheTrace | None:
        return self.tracer.finish(slot, output_tokens, steps, fidelity)

    @contextlib.contextmanager
    def attach(self, model):
        """The state's context (the packed store's attention), then the scorer's (a query capture,
        which then records through it)."""
        with self.state.attach(model), self.scorer.attach(model) as got:
            yield got

    def prepare(self, tokenizer) -> None:
        """What the mechanisms read from the run's tokenizer (the newline cadence's line breaks)."""
        self.cadence.prepare(tokenizer)

    def reset(self) -> None:
        """A run starts: clear every mechanism's per-run state."""
        self.scorer.reset()
        self.tracer.reset()

    def reset_slot(self, slot: int, seed: int) -> None:
        """Engine slot `slot` starts a new sequence whose seed is `seed`."""
        self.scorer.reset_slot(slot, seed)
        self.state.reset_slot(slot, seed)
        self.decoding.reset_slot(slot, seed)
        self.tracer.begin(slot)

    def row_kib(self, cache: RetentionCache, row: int, kib_per_token: float) -> float | None:
        """KiB row `row` stores now (None: stored tokens x kib_per_token, every token in full precision)."""
        return self.state.row_kib(cache, row, kib_per_token)

    def due_rows(self, cache: RetentionCache, prefill: bool, tokens: list[int] | None = None,
                 active: list[bool] | None = None) -> list[int]:
        """The rows to compact now; `active[r]` False: a padding row (no sequence), never due."""
        if not self.scorer.evicts:
            return []
        toks = tokens if tokens is not None else [None] * cache.rows
        return [r for r, n in enumerate(cache.lengths) if (active is None or active[r])
                and self.cadence.due(n, prefill, cache.prompt_lengths[r], toks[r])]

    def after_forward(self, cache: RetentionCache, next_position, meter, prefill: bool,
                      tokens: list[int] | None = None) -> bool:
        """Let the scorer observe the step, then compact the rows that are due. Returns True if any was.

        next_position: the absolute position of each row's next query (a list, or one int for a
        single-row cache); meter: each row's `BudgetMeter` (a list, or one meter for a single row;
        None for a padding row of the engine's static step: it holds no sequence, is never compacted,
        and whatever the scorer observes in it is dropped when its slot starts a sequence);
        tokens: the id each row's forward just wrote (host ints; None at prefill).
        """
        rows = cache.rows
        nxt = [int(next_position)] * rows if isinstance(next_position, int) else [int(t) for t in next_position]
        meters = [meter] * rows if isinstance(meter, BudgetMeter) else list(meter)
        active = None if all(m is not None for m in meters) else [m is not None for m in meters]
        if prefill:
            self.tracer.prefilled(cache)
        self.scorer.observe(cache, nxt)
        due = self.due_rows(cache, prefill, tokens, active)
        if due:
            self._compact(cache, due, nxt, meters)
        kib = next(m.kib_per_token for m in meters if m is not None)
        self.state.after_step(cache, nxt, kib)
        return bool(due)

    def select(self, view, k: int):
        """What the rows of `view` keep: the routing's kept indices and its `Allocation` (None
        unless its counts differ across layers and heads), from the scorer's scores."""
        return self.routing.keep(self.scorer, self.scorer.score(view), view, k)

    def _compact(self, cache: RetentionCache, due: list[int], nxt: list[int], meters: list[BudgetMeter]) -> None:
        """Compact the rows `due`, in groups that keep the same number of tokens."""
        groups: dict[int, list[int]] = {}
        for r in due:
            groups.setdefault(self.cadence.keep(cache.prompt_lengths[r]), []).append(r)
        c = self.cadence
        for k, grp in groups.items():
            below = [c.protected_prompt(cache.prompt_lengths[r], k) for r in grp] if c.prompt_counted else None
            view = cache.view([nxt[r] for r in grp], sink=c.sink, recent=c.recent, rows=grp,
                              prompt_length=[cache.prompt_lengths[r] for r in grp],
                              protect_prompt=c.protect_prompt, slots=[cache.slots[r] for r in grp],
                              prompt_below=below)
            keep, allocation = self.select(view, k)
            self.state.before_compaction(cache, grp, keep, view)
            if allocation is None:
                cache.compact_rows(grp, keep)
            else:
                cache.compact_rows(grp, keep, allocation)
            self.state.after_compaction(cache, grp, nxt, meters[grp[0]].kib_per_token)
            self.tracer.compacted(cache, grp, keep, view, self)
            self.scorer.compacted(keep, view)
            for r in grp:
                meters[r].note_compaction([cache.lengths[r]])


def cadence_for(scorer: Scorer, budget: int | None, interval: int | None = None, accounting: str = "mean",
                sink: int | None = None, recent: int | None = None, protect_prompt: bool = False,
                kind: type[Cadence] = Cadence, params: dict | None = None,
                prompt_counted: bool | None = None) -> Cadence:
    """The cadence (`kind`, with its own `params`) of `scorer` at `budget`: no budget for a scorer
    that never evicts, the default interval `min(128, B)` (shortened so that `b` stays at least the
    protected tokens + 1 under the cadence's span), the scorer's own protected tokens unless
    `sink`/`recent` are given, and at least the window a window scorer always keeps (`min_recent`);
    `prompt_counted` None: the scorer's own prompt rule (`default_prompt`) unless `protect_prompt`."""
    budget = budget if scorer.evicts else None
    if prompt_counted is None:
        prompt_counted = scorer.default_prompt == "keep" and not protect_prompt
    sink = scorer.default_sink if sink is None else sink
    recent = max(scorer.default_recent if recent is None else recent, scorer.min_recent())
    params = dict(params or {})
    if interval is None and budget and scorer.default_interval is not None:
        interval = scorer.default_interval  # a preset's own cadence (random-pp: the reference's window)
    if interval is None and budget:
        floor = max(1, sink + recent + 1)
        extra = kind(budget=None, interval=1, **params).span - 1  # span beyond the interval (newline: max_wait)
        interval = default_interval(budget, accounting, floor)
        while interval > 1 and nominal_budget(budget, interval + extra, accounting) < floor:
            interval -= 1  # a longer span (newline's max_wait) needs a shorter interval at small budgets
    return kind(budget=budget, interval=interval or 1, accounting=accounting, sink=sink, recent=recent,
                protect_prompt=protect_prompt and budget is not None,
                prompt_counted=prompt_counted and budget is not None, **params)
