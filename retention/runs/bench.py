"""Benchmarks: decode speed, compaction cost, measured cache, memory and agreement with the full cache.

Figures come from here, never from timed assertions in tests. Everything is greedy so that runs are
comparable token for token.

* speed: for every context (the first dev problem's prompt, or `--context C` tokens of real text: dev
  problems concatenated) and every batch size `S`, every variant decodes `S` copies of the same
  prompt for `new_tokens` tokens (EOS ignored). Variants: the scorers (per accounting mode, through
  the batched engine) and two references on plain transformers `DynamicCache`s: `dynamic-cache`
  (the baseline every ratio is taken against) and `ideal-crop` (the cache cut to the newest `budget`
  tokens after every step, no scoring: the ceiling of any retention policy). All variants of one
  (context, batch size) run in lockstep, one decode step of each in turn, so machine noise hits all
  alike. One row per (variant, accounting, batch size, context): aggregate decode tokens/s, median
  step time, compaction share of the step time, measured mean/peak cache, the cache bytes
  allocated and stored per sequence, and the host synchronisations per decode step (every host read
  of a tensor during the variant's timed steps, compactions included, counted by
  `retention.runtime.syncs.count_host_reads`).
* agreement: per scorer, on `problems` dev problems (`agreement_tokens` each, EOS ignored), the number
  of output tokens identical to the `full` run before the first divergence.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from retention.models import format_prompt
from retention.runs.arms import validate_arm
from retention.runs.roofline import decode_step_flops, matmul_peak_gflops, roofline_line
from retention.runs.equal_memory import equal_memory_rows, format_memory_table, plan_arms
from retention.runs.scorer_options import scorer_fields
from retention.runtime.engine import Engine, Request, SamplingConfig, cache_kwarg
from retention.runtime.generate import generate
from retention.runtime.syncs import count_host_reads, synced_now
from retention.policy.registry import get_scorer_class, new_run_entry
from retention.versions import library_versions

DYNAMIC = "dynamic-cache"
IDEAL = "ideal-crop"
REFERENCE_VARIANTS = (DYNAMIC, IDEAL)


def split_variant(variant: str) -> tuple[str, str | None]:
    """A variant is a scorer, or `SCORER+STATE` with a state mechanism at its defaults for a new run
    (`triattention+quant`: TriAttention over the packed int8 store)."""
    scorer, _, state = variant.partition("+")
    return scorer, state or None


def variant_policy(model: str, variant: str, budget: int | None, interval: int | None, accounting: str, params: dict):
    """The policy of one variant, built as `retention run` builds an arm (`validate_arm` -> ArmSpec);
    `params` are shared by every variant: each scorer takes the ones it has."""
    scorer, state = split_variant(variant)
    fields = scorer_fields(scorer)
    evicts = get_scorer_class(scorer).evicts
    arm = {"model": model, "scorer": scorer, "budget": budget if evicts else None,
           "interval": interval if evicts else None, "accounting": accounting,
           "scorer_params": {k: v for k, v in params.items() if k in fields and v is not None}}
    if state is not None:
        arm["state"] = new_run_entry("state", state)
    return validate_arm(arm).policy()


def _median_ms(xs: list[float]) -> float | None:
    return 1000 * statistics.median(xs) if xs else None


def context_prompt(tokenizer, problems, tokens: int) -> list[int]:
    """`tokens` token ids of real text: the dev problems' statements concatenated (repeated if short)."""
    ids: list[int] = []
    i = 0
    while len(ids) < tokens:
        ids += tokenizer(problems[i % len(problems)].problem + "\n\n", add_special_tokens=False)["input_ids"]
        i += 1
    return ids[:tokens]


class _EngineStepper:
    """A scorer variant: the batched engine on `S` copies of the prompt."""

    def __init__(self, loaded, prompt, scorer, budget, interval, accounting, params, S, new_tokens):
        self.name, self.accounting, self.model = scorer, accounting, loaded.model  # scorer: the variant's name
        self.policy = variant_policy(loaded.name, scorer, budget, interval, accounting, params)
        self.gens = []
        cfg = SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True)
        self.engine = Engine(loaded.model, [Request(i, prompt) for i in range(S)], self.policy, cfg, set(),
                             loaded.geometry.kib_per_token, batch_size=S,
                             on_finish=lambda r, g: self.gens.append((r.key, g)))
        self.stored: list[int] = []

    def prefill(self):
        with self.policy.attach(self.model):
            self.engine.fill()

    def step(self):
        with self.policy.attach(self.model):
            self.engine.step()
        if self.engine.cache is not None and self.engine.rows:
            self.stored.append(self.engine.cache.stored_bytes())

    @property
    def done(self):
        return self.engine.done

    def figures(self, S):
        g = dict(self.gens)[0]
        st = self.engine.stats
        m = g.meter
        return {"compactions": len(g.compaction_seconds), "compaction_ms_median": _median_ms(g.compaction_seconds),
                "compaction_seconds": st.compaction_seconds, "cache_mean_tokens": m.mean,
                "cache_peak_tokens": m.peak, "cache_final_tokens": m.final, "budget_exceeded": m.exceeded,
                "cache_peak_kib": m.peak_kib,
                "allocated_bytes_per_sequence": st.allocated_bytes / S,
                "stored_bytes_per_sequence": statistics.mean(self.stored) / S if self.stored else 0.0}


class _DynamicStepper:
    """A reference variant on transformers' `DynamicCache`: `crop=None` plain decode, else the cache
    is cut to its newest `crop` tokens after every step (no scoring)."""

    def __init__(self, loaded, prompt, S, crop: int | None):
        self.name, self.accounting = (DYNAMIC if crop is None else IDEAL), None
        self.model, self.crop, self.kw = loaded.model, crop, cache_kwarg(loaded.model)
        self.kib = loaded.geometry.kib_per_token
        self.dev = next(loaded.model.parameters()).device
        self.cache = DynamicCache(config=loaded.model.config)
        self.prompt, self.S = prompt, S
        self.lengths: list[int] = []
        self.stored: list[int] = []
        self.pos = len(prompt)
        self.tok = None
        self.compaction_seconds = 0.0

    def _forward(self, ids, pos):
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{self.kw: self.cache})
        return out.logits[:, -1]

    def _cut(self):
        if self.crop is not None:
            for layer in self.cache.layers:
                if layer.keys.shape[-2] > self.crop:
                    layer.keys, layer.values = layer.keys[:, :, -self.crop:], layer.values[:, :, -self.crop:]

    def prefill(self):
        ids = torch.tensor([self.prompt] * self.S, device=self.dev)
        pos = torch.arange(len(self.prompt), device=self.dev)[None].expand(self.S, -1)
        self.tok = self._forward(ids, pos).argmax(-1, keepdim=True)
        self._cut()

    def step(self):
        pos = torch.full((self.S, 1), self.pos, device=self.dev)
        logits = self._forward(self.tok, pos)
        layer = self.cache.layers[0]
        self.lengths.append(layer.keys.shape[-2])
        self.stored.append(sum(2 * ly.keys.numel() * ly.keys.element_size() for ly in self.cache.layers))
        self._cut()
        self.tok = logits.argmax(-1, keepdim=True)
        self.tok.tolist()  # the same host read of the tokens as the engine's EOS check
        self.pos += 1

    done = False

    def figures(self, S):
        stored = statistics.mean(self.stored) / S if self.stored else 0.0
        return {"compactions": 0, "compaction_ms_median": None, "compaction_seconds": 0.0,
                "cache_mean_tokens": statistics.mean(self.lengths), "cache_peak_tokens": max(self.lengths),
                "cache_peak_kib": max(self.lengths) * self.kib,
                "cache_final_tokens": self.lengths[-1], "budget_exceeded": False,
                "allocated_bytes_per_sequence": stored, "stored_bytes_per_sequence": stored}


def speed_rows(loaded, prompt: list[int], variants: list[str], budget: int, new_tokens: int, accountings: list[str],
               batch_size: int, interval: int | None, params: dict, context: int | None) -> list[dict]:
    """One lockstep measurement of every variant at one batch size and context (module doc)."""
    steppers = []
    for v in variants:
        if v == DYNAMIC:
            steppers.append(_DynamicStepper(loaded, prompt, batch_size, None))
        elif v == IDEAL:
            steppers.append(_DynamicStepper(loaded, prompt, batch_size, budget))
        else:
            for acc in accountings:
                steppers.append(_EngineStepper(loaded, prompt, v, budget, interval, acc, params, batch_size, new_tokens))
    times = [[] for _ in steppers]
    running = [None]  # the index of the stepper whose decode step is running (None: set-up)
    with torch.inference_mode(), count_host_reads(lambda: running[0]) as reads:
        for s in steppers:
            s.prefill()
        for _ in range(new_tokens - 1):  # the first token comes from the prefill
            for i, (s, ts) in enumerate(zip(steppers, times)):
                t0 = synced_now(torch.device(loaded.device))
                running[0] = i
                s.step()
                running[0] = None
                ts.append(synced_now(torch.device(loaded.device)) - t0)
    rows = []
    for i, (s, ts) in enumerate(zip(steppers, times)):
        fig = s.figures(batch_size)
        total = sum(ts)
        rows.append({
            "variant": s.name, "scorer": s.name, "accounting": s.accounting, "batch_size": batch_size,
            "context": context, "prompt_tokens": len(prompt), "steps": len(ts),
            "tokens_per_second": batch_size * len(ts) / total,
            "step_ms_median": _median_ms(ts), "decode_step_ms_median": _median_ms(ts),
            "host_syncs_per_step": reads[i] / len(ts) if ts else 0.0,
            "compaction_share": fig.pop("compaction_seconds") / total, **fig,
        })
    return rows


def run_bench(loaded, problems, scorers: list[str], budget: int, new_tokens: int, accountings: list[str],
              agreement_problems: int, interval: int | None = None, params: dict | None = None,
              agreement_tokens: int | None = None, echo=print, batch_sizes: list[int] | None = None,
              contexts: list[int | None] | None = None, memory_mib: float | None = None,
              memory_sequences: int | None = None, memory_max_slots: int = 256) -> dict:
    """Returns a JSON-ready dict of figures; `echo` receives one line per measurement.

    scorers may include the reference variants `dynamic-cache` and `ideal-crop`; contexts: `None` =
    the first dev problem's prompt, an int = that many tokens of real text. memory_mib: also measure
    every engine arm at its slots in that much KV memory, per context (`retention.runs.equal_memory`)."""
    params = params or {}
    batch_sizes = batch_sizes or [1]
    contexts = contexts or [None]
    kib = loaded.geometry.kib_per_token
    style = getattr(loaded, "prompt", "chat")  # the model's own prompt, as `retention run` builds it
    math_prompt = format_prompt(loaded.tokenizer, problems[0].problem, style)
    out = {"model": loaded.name, "model_id": loaded.model_id, "dtype": loaded.dtype, "device": loaded.device,
           "budget": budget, "new_tokens": new_tokens, "prompt_tokens": len(math_prompt), "batch_sizes": batch_sizes,
           "contexts": contexts, "lockstep": True, "versions": library_versions(), "speed": [], "agreement": [],
           "memory_mib": memory_mib, "equal_memory": []}
    # One warm-up generation so that first-call overheads do not land on the first variant.
    generate(loaded.model, math_prompt, variant_policy(loaded.name, "full", None, None, "mean", {}), SamplingConfig(max_new_tokens=8), set(),
             kib)
    peak = None
    for ctx in contexts:
        prompt = math_prompt if ctx is None else context_prompt(loaded.tokenizer, problems, ctx)
        for bs in batch_sizes:
            for row in speed_rows(loaded, prompt, scorers, budget, new_tokens, accountings, bs, interval, params, ctx):
                out["speed"].append(row)
                comp = row["compaction_ms_median"]
                echo(f"{row['variant']:>13} {row['accounting'] or '-':>7} S={bs:<3} ctx={len(prompt):<5}: "
                     f"{row['tokens_per_second']:8.2f} tok/s, step {row['step_ms_median']:.1f} ms, "
                     f"compaction {'-' if comp is None else f'{comp:.1f} ms'} x{row['compactions']} "
                     f"({100 * row['compaction_share']:.1f}% of steps), mean cache {row['cache_mean_tokens']:.1f} "
                     f"peak {row['cache_peak_tokens']}, host syncs/step {row['host_syncs_per_step']:.2f}, KiB/seq allocated "
                     f"{row['allocated_bytes_per_sequence'] / 1024:.0f} stored {row['stored_bytes_per_sequence'] / 1024:.0f}")
        biggest = [r for r in out["speed"] if r["context"] == ctx and r["batch_size"] == batch_sizes[-1]
                   and r["accounting"] is not None]
        if peak is None and biggest:
            peak = out["matmul_peak_gflops"] = matmul_peak_gflops(loaded.model.dtype, device=str(loaded.device))
        for r in biggest:  # the roofline of the widest step (docs/speed.md)
            flops = decode_step_flops(loaded.model.config, r["batch_size"], r["cache_mean_tokens"])
            r["step_gflop"] = flops / 1e9
            r["step_gflops_per_second"] = flops / (r["step_ms_median"] / 1000) / 1e9
            echo(roofline_line(f"{r['variant']}/{r['accounting']}", r["batch_size"], r["cache_mean_tokens"],
                               r["step_ms_median"], flops, peak))
        if memory_mib:
            same = [r for r in out["speed"] if r["context"] == ctx and r["batch_size"] == batch_sizes[-1]]
            arms = plan_arms(same, memory_mib, memory_max_slots)
            mem = equal_memory_rows(
                loaded, prompt, arms, lambda a: variant_policy(loaded.name, a.variant, budget, interval, a.accounting,
                                                               params), new_tokens, memory_sequences)
            for r in mem:
                r["context"] = ctx
            out["equal_memory"] += mem
            echo(format_memory_table(memory_mib, mem, same))
    if agreement_problems:
        greedy = SamplingConfig(max_new_tokens=agreement_tokens or new_tokens, temperature=0.0, ignore_eos=True)
        out["agreement_tokens"] = greedy.max_new_tokens
        t0 = time.perf_counter()
        ref = {}
        for p in problems[:agreement_problems]:
            ids = format_prompt(loaded.tokenizer, p.problem, style)
            ref[p.unique_id] = (ids, generate(loaded.model, ids, variant_policy(loaded.name, "full", None, None, "mean", {}), greedy, set(), kib).token_ids)
        for scorer in scorers:
            if scorer == "full" or scorer in REFERENCE_VARIANTS:
                continue
            agree = []
            for pid, (ids, ref_tokens) in ref.items():
                toks = generate(loaded.model, ids, variant_policy(loaded.name, scorer, budget, interval, "mean", params), greedy, set(), kib).token_ids
                agree.append(next((i for i, (a, b) in enumerate(zip(toks, ref_tokens)) if a != b), len(ref_tokens)))
            out["agreement"].append({"scorer": scorer, "tokens_before_divergence": agree,
                                     "mean": sum(agree) / len(agree)})
            echo(f"{scorer:>12} agreement with full: {agree} (mean {sum(agree) / len(agree):.1f} of {greedy.max_new_tokens})")
        out["agreement_seconds"] = time.perf_counter() - t0
    return out
