"""The contract kit: the invariants every scorer must hold, checked on tiny random models.

`run_checks(spec, params)` decodes twelve requests on `tiny-random` in float64 (where batched and
single decodes agree to the last token) under budget 20, interval 4 (b = 17: every prompt but the
shortest is compacted at prefill, and rows fall due together and apart), greedy, EOS ids chosen to
end sequences at different steps, and returns one `CheckResult` per check. A cadence that lets a row
store more than the interval above `b` (`span > N`, e.g. `newline`'s wait for a line break) is
checked at the budget that keeps `b = 17` under its span and a decode longer by `span - N` tokens, so
that every row falls due within the decode (`_Kit.budget`, `_Kit.new_tokens`):

* kept count: every compaction keeps exactly the cadence's k distinct tokens per row (and head); an
  allocating routing's compaction keeps each head's count, the counts of every row summing to
  `L x G x k` (and `routing allocation` says that heads did get different counts);
* view unchanged: `score` and `select` write into none of the view's tensors (named when they do);
* protected tokens kept; padding never kept; score shape and dtype;
* batch invariance: batch 8 with refills vs batch 1, identical tokens, finish reasons, meters and
  kept sets (views of several rows and rows due at different steps both occur, as the detail says);
* physical eviction: after a compaction the buffers hold exactly the kept positions, each row stores
  what its meter counts (recounted per layer and KV head from the buffers, a ragged row's holes
  excluded), the bytes stored are those tokens';
* mean budget held: no sequence's measured mean cache is above the budget;
* determinism: two runs with fresh scorers give the same tokens and kept sets;
* resume: a run interrupted after two records and resumed (`retention.runs.runner`) writes the records an
  uninterrupted run writes (seeded sampling, so per-sequence seeds matter too);
* host reads per token: the scorer's per-forward hook (`observe`) reads nothing on the host, and
  everything outside the scorer's hooks reads exactly the engine's documented reads (one per step,
  one per started sequence, two or three per narrowing of the tail); the reads at compactions and
  set-up are reported;
* compaction share at an 8k context: a figure (float32 tiny-random, one sequence, decode steps only).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from retention.contract.probe import MAX_NOTES, CheckedDecoding, CheckedPolicy, Phased, Probe, count_host_reads
from retention.errors import RetentionError
from retention.models import load_model, resolve_model
from retention.runs.arms import check_scorer_reads, validate_arm
from retention.runs.runner import Arm, RunDir, run_arms
from retention.runs.scorer_options import scorer_fields
from retention.policy.cadence.base import Cadence
from retention.runs.settings import Output, RunSettings, Sampling
from retention.runtime.engine import Engine, Request, SamplingConfig, run_engine
from retention.policy.composite import RetentionPolicy, cadence_for
from retention.policy.registry import get_scorer_class, make_scorer
from retention.policy.scoring.calibration import calibrate

BUDGET, INTERVAL, NEW_TOKENS = 20, 4, 24
# Twelve prompts of 13..69 tokens (eight lengths), so rows are padded, compact at prefill or not, and
# refill slots (batch 8) at different steps.
PROMPTS = [list(range(3 + i, 16 + 8 * i)) for i in range(8)] + [list(range(40 + i, 60 + 7 * i)) for i in range(4)]


@dataclass
class CheckResult:
    name: str
    ok: bool | None  # None: a figure, not a pass/fail
    detail: str

    def line(self) -> str:
        tag = "INFO" if self.ok is None else "PASS" if self.ok else "FAIL"
        return f"{tag} {self.name}: {self.detail}"


def _stats_for(params: dict, spec: str, model, tmp: Path) -> dict:
    """Calibration statistics for a scorer that takes `stats` and was given none (tiny-random's own)."""

    if "stats" not in scorer_fields(spec) or params.get("stats"):
        return params

    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
    return dict(params, stats=str(calibrate(model, ids).save(tmp / "tiny.safetensors")))


class _Kit:
    """The arm under test (built by `validate_arm`, as `run` builds it) and the tiny models."""

    def __init__(self, spec: str, params: dict, tmp: Path, mechanisms: dict | None = None, as_named: bool = False):
        self.spec, self.tmp = spec, tmp
        check_scorer_reads(spec, resolve_model("tiny-random"), "float32")  # what `run` checks, first
        self.loaded = load_model("tiny-random")
        self.params = _stats_for(params, spec, self.loaded.model, tmp)
        arm = {"model": "tiny-random", "scorer": spec, "scorer_params": self.params, "interval": INTERVAL,
               **(mechanisms or {})}
        if get_scorer_class(spec).default_recent >= BUDGET - INTERVAL // 2 - 1:
            # A preset's window wider than the kit's b (random-pp's 64) is the cadence's, not the
            # scorer's contract: checked with a window of N, its other defaults (the prompt rule) kept.
            arm["recent"] = INTERVAL
        # The cadence's span at a budget any span fits, then the budget that keeps b at the fixed
        # cadence's (module doc): b = B - span//2 - 1 in mean accounting.
        span = validate_arm(dict(arm, budget=1 << 16)).cadence.span
        b = BUDGET - INTERVAL // 2 - 1
        self.budget = max(BUDGET, b + span // 2 + 1)
        self.new_tokens = NEW_TOKENS + max(0, span - INTERVAL)
        self.arm = validate_arm(dict(arm, budget=self.budget), as_named)
        self.make = self.arm.build_scorer
        self.m64 = copy.deepcopy(self.loaded.model).to(torch.float64)
        self.sc0 = self.make()
        self.cadence = self.arm.cadence

    def policy(self, scorer, checked: bool = True) -> RetentionPolicy:
        """The arm's policy around `scorer` (a `Probe`): its own cadence, routing, state, decoding
        (the routing's and the state's host reads at compactions reported with the scorer's)."""
        p = self.arm.policy()
        p.prepare(self.loaded.tokenizer)
        decoding = getattr(p.decoding, "inner", p.decoding)  # the kit checks it itself (no run guard)
        return (CheckedPolicy if checked else RetentionPolicy)(scorer, p.cadence, Phased(p.routing, scorer),
                                                               Phased(p.state, scorer),
                                                               CheckedDecoding(decoding) if checked else decoding)

    def decode(self, batch_size: int, eos=frozenset(), checks=True, scorer=None, new_tokens=None):
        """One engine run over PROMPTS: ({seed: Generation}, probe, policy, engine stats)."""
        new_tokens = new_tokens or self.new_tokens

        probe = Probe(scorer or self.make(), checks=checks)
        policy = self.policy(probe, checks)
        out = {}
        reqs = [Request(i, p, i) for i, p in enumerate(PROMPTS)]
        stats = run_engine(self.m64, reqs, policy, SamplingConfig(max_new_tokens=new_tokens), set(eos), 1.0,
                           batch_size=batch_size, on_finish=lambda r, g: out.__setitem__(r.key, g))
        return out, probe, policy, stats


def _same(a: dict, b: dict, pa: Probe, pb: Probe) -> str | None:
    """The first difference between two runs (tokens, finish, meter, kept sets), or None."""
    for i in sorted(a):
        ga, gb = a[i], b.get(i)
        if gb is None:
            return f"sequence {i} missing"
        if ga.token_ids != gb.token_ids:
            step = next((t for t, (x, y) in enumerate(zip(ga.token_ids, gb.token_ids)) if x != y),
                        min(len(ga.token_ids), len(gb.token_ids)))
            return f"sequence {i}: tokens differ from step {step}"
        if ga.finish_reason != gb.finish_reason or ga.meter.summary() != gb.meter.summary():
            return f"sequence {i}: finish reason or meter differ"
        if pa.kept.get(i) != pb.kept.get(i):
            ka, kb = pa.kept.get(i, []), pb.kept.get(i, [])
            c = next((c for c, (x, y) in enumerate(zip(ka, kb)) if x != y), min(len(ka), len(kb)))
            return f"sequence {i}: kept set of compaction {c} differs"
    return None


def _guard(name: str, fn) -> CheckResult:
    try:
        return fn()
    except RetentionError as exc:
        return CheckResult(name, False, f"error: {exc}")
    except Exception as exc:  # noqa: BLE001 - the scorer under test may raise anything: that is a failure
        return CheckResult(name, False, f"raised {type(exc).__name__}: {exc}")


def _violations(name: str, notes: list[str], ok_detail: str) -> CheckResult:
    if notes:
        more = f" (+{len(notes) - MAX_NOTES} more)" if len(notes) > MAX_NOTES else ""
        return CheckResult(name, False, "; ".join(notes[:MAX_NOTES]) + more)
    return CheckResult(name, True, ok_detail)


def run_checks(spec: str, params: dict | None = None, *, context: int = 8192, share: bool = True,
               share_budget: int = 1024, share_tokens: int = 512, mechanisms: dict | None = None) -> list[CheckResult]:
    """Every check of the contract on scorer `spec` (a built-in name or a plugin) with `params`, in an
    arm whose other families are `mechanisms` (family -> a name or `{"name", "params"}`).
    share: also measure the compaction share of decode time at a `context`-token prompt."""
    with tempfile.TemporaryDirectory(prefix="retention-check-") as tmp:
        try:
            kit = _Kit(spec, dict(params or {}), Path(tmp), mechanisms)
        except RetentionError as exc:
            return [CheckResult("set-up", False, str(exc))]
        except Exception as exc:  # noqa: BLE001
            return [CheckResult("set-up", False, f"raised {type(exc).__name__}: {exc}")]
        return _all_checks(kit, context, share, share_budget, share_tokens)


def _all_checks(kit: _Kit, context, share, share_budget, share_tokens) -> list[CheckResult]:
    results: list[CheckResult] = []
    evicts = kit.sc0.evicts
    try:
        full, _, _, _ = kit.decode(8, checks=False, scorer=_full_scorer())
        # EOS ids that end four of the sequences at different steps (read off a full-cache decode).
        eos = {full[i].token_ids[4 + 3 * i] for i in range(0, 8, 2)}
        single = kit.decode(1, eos)
        batched = kit.decode(8, eos)
        padded = _padded_views(kit)
    except Exception as exc:  # noqa: BLE001 - a scorer that cannot decode fails every decode check
        what = f"decoding raised {type(exc).__name__}: {exc}"
        names = ("score shape and dtype", "kept count", "view unchanged", "protected tokens kept", "padding never kept",
                 "physical eviction", "bytes recounted", "decoding output", "mean budget held", "batch invariance")
        results += [CheckResult(n, False, what) for n in names]
        single = batched = None
    if single is not None:
        (g1, p1, pol1, _), (g8, p8, pol8, _) = single, batched
        compactions = sum(len(v) for v in p8.kept.values())
        note = f"{compactions} compactions" if evicts else "never evicts: no compaction"
        viol = {k: p1.violations.get(k, []) + p8.violations.get(k, []) + padded.violations.get(k, [])
                for k in ("score shape and dtype", "kept count", "view unchanged", "protected tokens kept",
                          "padding never kept")}
        if evicts and compactions == 0:
            viol["kept count"] = viol["kept count"] + ["no compaction happened"]
        k = kit.cadence.nominal
        results.append(_violations("score shape and dtype", viol["score shape and dtype"],
                                   f"{'[L, B, G, n]' if kit.sc0.per_layer else '[B, G, n]'} floating point, no NaN"
                                   if evicts else note))
        results.append(_violations("kept count", viol["kept count"], f"k = {k} at each of {note}" if evicts else note))
        results.append(_violations("view unchanged", viol["view unchanged"],
                                   "score and select wrote into no tensor of their views" if evicts else note))
        results.append(_violations("protected tokens kept", viol["protected tokens kept"],
                                   f"sink {kit.cadence.sink}, recent {kit.cadence.recent} kept" if evicts else note))
        if evicts and not padded.view_rows:
            viol["padding never kept"] = viol["padding never kept"] + ["no padded view could be built"]
        results.append(_violations("padding never kept", viol["padding never kept"],
                                   f"{len(padded.view_rows)} padded views of up to {max(padded.view_rows, default=0)} "
                                   "rows of different lengths" if evicts else note))
        results.append(_violations("physical eviction", pol1.violations + pol8.violations,
                                   "buffers hold the kept positions; stored = meter = bytes after every forward"))
        results.append(_violations("bytes recounted", pol1.byte_violations + pol8.byte_violations,
                                   "every row's metered KiB finite and not below what its buffers need "
                                   "(recounted from the stored values)"))
        results.append(_violations("decoding output", pol1.decoding.violations + pol8.decoding.violations,
                                   "every adjusted logits tensor has the given shape and dtype, no NaN or +inf, "
                                   "a token left to draw in every row"))
        if kit.arm.policy().routing.allocates:
            results.append(_allocation(p8, kit))
        over = [f"sequence {i}: mean {g.meter.mean:.2f} > {kit.budget}" for gens in (g1, g8)
                for i, g in sorted(gens.items()) if g.meter.exceeded or not math.isfinite(g.meter.mean)]
        worst = max((g.meter.mean for g in g8.values()), default=0.0)
        results.append(_violations("mean budget held", over, f"largest mean cache {worst:.2f} <= budget {kit.budget}"
                                   if evicts else "never evicts (no budget)"))
        diff = _same(g1, g8, p1, p8)
        lengths = sorted({len(g.token_ids) for g in g8.values()})
        shape = f"{len(g8)} sequences of {lengths[0]}..{lengths[-1]} tokens, {len(PROMPTS) - 8} refills; " + (
            f"views of up to {max(p8.view_rows, default=0)} rows, compactions at {len(p8.due_calls)} distinct steps"
            if evicts else "never evicts")
        if evicts and (max(p8.view_rows, default=0) < 2 or len(p8.due_calls) < 2):
            diff = diff or "the run did not produce both multi-row views and rows due at different steps"
        results.append(CheckResult("batch invariance", diff is None, (diff + "; " if diff else "") + shape))
        results.append(_guard("determinism", lambda: _determinism(kit, eos, batched)))
    results.append(_guard("resume", lambda: _resume(kit)))
    results.append(_guard("host reads per token", lambda: _host_reads(kit)))
    if share:
        results.append(_guard("compaction share", lambda: _share(kit, context, share_budget, share_tokens)))
    return results


@dataclass
class _PaddingPolicy(RetentionPolicy):
    """Besides compacting as usual, scores and selects (without compacting) a view over rows of
    different lengths, padded to the longest, a few times: the cadence alone only builds views of
    rows due at the same length, so padding reaches a scorer only through such views."""

    tries: int = 4

    def after_forward(self, cache, next_position, meter, prefill: bool, tokens=None) -> bool:
        did = super().after_forward(cache, next_position, meter, prefill, tokens)
        c, k = self.cadence, self.cadence.nominal
        rows = [r for r in range(cache.rows) if cache.lengths[r] > k]
        if prefill or self.tries <= 0 or len({cache.lengths[r] for r in rows}) < 2:
            return did
        self.tries -= 1
        nxt = [int(next_position)] * cache.rows if isinstance(next_position, int) else list(next_position)
        view = cache.view([nxt[r] for r in rows], sink=c.sink, recent=c.recent, rows=rows,
                          prompt_length=[cache.prompt_lengths[r] for r in rows], protect_prompt=c.protect_prompt,
                          slots=[cache.slots[r] for r in rows],
                          prompt_below=[c.protected_prompt(cache.prompt_lengths[r], k) for r in rows]
                          if c.prompt_counted else None)
        self.scorer.select(self.scorer.score(view), view, k)  # the probe checks what comes back
        return did


def _padded_views(kit: _Kit) -> Probe:
    """A batch-8 decode whose policy also offers the scorer padded views (`_PaddingPolicy`)."""

    probe = Probe(kit.make())
    if not kit.sc0.evicts:
        return probe
    # Under the fixed cadence at the arm's b and interval: padding is the scorer's to handle, and a
    # cadence that keeps rows apart (newline's wait) must not leave the check without a padded view.
    c = kit.cadence
    fixed = Cadence(budget=c.budget, interval=c.interval, accounting=c.accounting, sink=c.sink, recent=c.recent,
                    protect_prompt=c.protect_prompt)
    # Prompts of b-3 .. b tokens: never compacted at prefill, so the rows keep lengths that differ by
    # less than the interval, whatever tokens the scorer leads to.
    b = fixed.nominal
    reqs = [Request(i, list(range(3, 3 + n)), i) for i, n in enumerate(range(max(1, b - 3), b + 1))]
    run_engine(kit.m64, reqs, _PaddingPolicy(probe, fixed), SamplingConfig(max_new_tokens=kit.new_tokens,
               ignore_eos=True), set(), 1.0, batch_size=8)
    probe.view_rows = [n for n, padded in zip(probe.view_rows, probe.padded) if padded]
    return probe


def _allocation(probe: Probe, kit: _Kit) -> CheckResult:
    """An allocating routing really allocated (some compaction gave heads different counts), and
    every allocation summed to the uniform total (the probe notes it under `kept count`)."""
    lo, hi = probe.count_range
    ok = probe.allocations > 0 and lo != hi and not probe.violations.get("kept count")
    detail = (f"{probe.allocations} allocating compactions, counts per (layer, KV head) {lo}..{hi}, every row "
              f"summing to L x G x k (mean k = {kit.cadence.nominal})" if probe.allocations else
              "no compaction gave heads different counts")
    return CheckResult("routing allocation", ok, detail)


def _full_scorer():

    return make_scorer("full")


def _determinism(kit: _Kit, eos, first) -> CheckResult:
    g8, p8 = first[0], first[1]
    again, pa, _, _ = kit.decode(8, eos)
    diff = _same(g8, again, p8, pa)
    return CheckResult("determinism", diff is None,
                       diff or "two runs with fresh scorers: identical tokens and kept sets")


class _Interrupt(BaseException):
    """Stands for a kill: not an Exception, so nothing on the way catches it."""


def _resume(kit: _Kit) -> CheckResult:
    """A run interrupted after two records, then resumed, writes what an uninterrupted run writes."""

    loaded = dataclasses.replace(kit.loaded, model=kit.m64)
    problems = [SimpleNamespace(unique_id=f"p{i}", problem="What is " + "1+" * (3 + 5 * i) + "1?", answer="1")
                for i in range(6)]
    # The run's settings as the kit decodes it (built directly: the float64 model is the kit's own).
    settings = RunSettings("tiny-random-float64", sampling=Sampling(kit.new_tokens, 0.6, 0.95, False, 0),
                           output=Output(batch_size=4, grade=False, progress=False))
    config = {"model": "tiny-random-float64", "scorer": kit.spec, "budget": kit.budget, "interval": INTERVAL}

    def run(path: Path, stop_after: int | None = None):
        rd = RunDir(path, config)
        if stop_after is not None:
            append = rd.records.append

            def interrupting(record):
                append(record)
                if len(rd.records.done) >= stop_after:
                    raise _Interrupt

            rd.records.append = interrupting
        try:
            run_arms(loaded, [Arm(rd, kit.arm)], problems, settings)
        except _Interrupt:
            pass
        finally:
            rd.close()
        return {k: {f: v for f, v in r.items() if f not in ("wall_seconds", "tokens_per_second", "batch_size")}
                for k, r in RunDir(path, config).records.done.items()}

    whole = run(kit.tmp / "whole")
    partial = run(kit.tmp / "resumed", stop_after=2)
    if len(partial) != 2:
        return CheckResult("resume", False, f"the interrupted run kept {len(partial)} records, expected 2")
    resumed = run(kit.tmp / "resumed")
    if resumed != whole:
        bad = sorted(k[0] for k in whole if resumed.get(k) != whole[k])
        return CheckResult("resume", False, f"records of {', '.join(bad)} differ after resuming")
    return CheckResult("resume", True, f"interrupted after 2 of {len(whole)} records, resumed: identical records")


def _host_reads(kit: _Kit) -> CheckResult:
    """The scorer's per-forward hook reads nothing on the host; the rest is reported."""
    def decode():

        probe = Probe(kit.make(), checks=False)
        reqs = [Request(i, p, i) for i, p in enumerate(PROMPTS)]
        with count_host_reads(probe) as counts:
            stats = run_engine(kit.m64, reqs, kit.policy(probe, checked=False),
                               SamplingConfig(max_new_tokens=kit.new_tokens, ignore_eos=True), set(), 1.0, batch_size=8)
        return counts, stats, probe

    counts, stats, probe = decode()
    detail = (f"observe {counts['observe']} in {probe.calls} forwards; engine {counts['engine']} in {stats.steps} "
              f"steps + {len(PROMPTS)} prefills + {stats.narrowed + stats.narrow_refused} tail narrowings "
              f"(documented: 1 per step, 1 per started sequence, 2 or 3 per narrowing; the engine counted "
              f"{stats.host_syncs} + {stats.start_syncs} + {stats.tail_syncs}); "
              f"score/select/compacted {counts['compaction']}, set-up {counts['setup']} in total")
    documented = stats.steps + len(PROMPTS) + stats.tail_syncs
    ok = counts["observe"] == 0 and counts["engine"] == documented == (stats.host_syncs + stats.start_syncs
                                                                       + stats.tail_syncs)
    return CheckResult("host reads per token", ok, detail)


def _share(kit: _Kit, context: int, budget: int, tokens: int) -> CheckResult:
    """Compaction share of decode time: one sequence with a `context`-token prompt (float32
    tiny-random), `tokens` decode steps timed after the prefill; the prefill's own compaction (the
    prompt cut to b) is not decode time and is left out of both figures."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (context,), generator=g).tolist()
    sc, arm = kit.make(), kit.arm.policy()  # the arm's own mechanisms at the figure's budget
    policy = RetentionPolicy(sc, cadence_for(sc, budget, kind=type(arm.cadence), params=kit.arm.cadence_spec.kwargs),
                             arm.routing, arm.state, arm.decoding)
    policy.prepare(kit.loaded.tokenizer)
    done = []
    eng = Engine(kit.loaded.model, [Request(0, prompt)], policy, SamplingConfig(max_new_tokens=tokens, ignore_eos=True),
                 set(), kit.loaded.geometry.kib_per_token, on_finish=lambda r, gen: done.append(gen))
    with torch.inference_mode(), policy.attach(kit.loaded.model):
        eng.fill()
        at_prefill, n_prefill = eng.stats.compaction_seconds, len(eng.rows[0].compact_s) if eng.rows else 0
        t0 = time.perf_counter()
        while eng.rows:
            eng.step()
        total = time.perf_counter() - t0
    comp = eng.stats.compaction_seconds - at_prefill
    n = len(done[0].compaction_seconds) - n_prefill if done else 0
    share = comp / total if total > 0 else 0.0
    detail = (f"{100 * share:.1f}% of decode time at a {context}-token context (budget {budget}, interval "
              f"{policy.cadence.interval}, {eng.stats.steps} decode steps, {n} compaction(s) of "
              f"{1000 * comp / max(n, 1):.1f} ms, {eng.stats.steps / total:.0f} tok/s; float32 tiny-random on "
              f"{kit.loaded.device})")
    return CheckResult("compaction share", None, detail)
