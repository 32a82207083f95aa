"""Benchmarks: decode speed, compaction cost, measured cache and agreement with the full cache.

Figures come from here, never from timed assertions in tests. Everything is greedy so that runs are
comparable token for token:

* speed: per scorer (and accounting mode), one fixed-length generation (`new_tokens`, EOS ignored)
  on the first dev problem: decode tokens/s, median decode-step time, median compaction time,
  measured mean/peak cache;
* agreement: per scorer, on `problems` dev problems (`agreement_tokens` each, EOS ignored), the number
  of output tokens identical to the `full` run before the first divergence.
"""

from __future__ import annotations

import statistics
import time


def _policy(scorer: str, budget: int | None, interval: int | None, accounting: str, params: dict):
    from retention.policy import RetentionPolicy, cadence_for
    from retention.scorers import make_scorer

    sc = make_scorer(scorer, **params)
    return RetentionPolicy(sc, cadence_for(sc, budget, interval, accounting))


def _median_ms(xs: list[float]) -> float | None:
    return 1000 * statistics.median(xs) if xs else None


def run_bench(loaded, problems, scorers: list[str], budget: int, new_tokens: int, accountings: list[str],
              agreement_problems: int, interval: int | None = None, params: dict | None = None,
              agreement_tokens: int | None = None, echo=print) -> dict:
    """Returns a JSON-ready dict of figures; `echo` receives one line per measurement."""
    from retention.generate import SamplingConfig, generate
    from retention.models import format_prompt
    from retention.runner import library_versions

    params = params or {}
    kib = loaded.geometry.kib_per_token
    greedy = SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    prompt = format_prompt(loaded.tokenizer, problems[0].problem)
    out = {"model": loaded.name, "model_id": loaded.model_id, "dtype": loaded.dtype, "device": loaded.device,
           "budget": budget, "new_tokens": new_tokens, "prompt_tokens": len(prompt),
           "versions": library_versions(), "speed": [], "agreement": []}
    # One warm-up generation so that first-call overheads do not land on the first scorer.
    generate(loaded.model, prompt, _policy("full", None, None, "mean", {}), SamplingConfig(max_new_tokens=8), set(), kib)
    for scorer in scorers:
        for acc in accountings:
            g = generate(loaded.model, prompt, _policy(scorer, budget, interval, acc, params), greedy, set(), kib)
            row = {
                "scorer": scorer, "accounting": acc,
                "tokens_per_second": len(g.token_ids) / g.wall_seconds,
                "decode_step_ms_median": _median_ms(g.decode_seconds),
                "compaction_ms_median": _median_ms(g.compaction_seconds),
                "compactions": len(g.compaction_seconds),
                "cache_mean_tokens": g.meter.mean, "cache_peak_tokens": g.meter.peak,
                "cache_final_tokens": g.meter.final, "budget_exceeded": g.meter.exceeded,
            }
            out["speed"].append(row)
            comp = row["compaction_ms_median"]
            echo(f"{scorer:>12} {acc:>7}: {row['tokens_per_second']:6.2f} tok/s, step {row['decode_step_ms_median']:.1f} ms, "
                 f"compaction {'-' if comp is None else f'{comp:.1f} ms'} x{row['compactions']}, "
                 f"mean cache {g.meter.mean:.1f} peak {g.meter.peak}")
    if agreement_problems:
        greedy = SamplingConfig(max_new_tokens=agreement_tokens or new_tokens, temperature=0.0, ignore_eos=True)
        out["agreement_tokens"] = greedy.max_new_tokens
        t0 = time.perf_counter()
        ref = {}
        for p in problems[:agreement_problems]:
            ids = format_prompt(loaded.tokenizer, p.problem)
            ref[p.unique_id] = (ids, generate(loaded.model, ids, _policy("full", None, None, "mean", {}), greedy, set(), kib).token_ids)
        for scorer in scorers:
            if scorer == "full":
                continue
            agree = []
            for pid, (ids, ref_tokens) in ref.items():
                toks = generate(loaded.model, ids, _policy(scorer, budget, interval, "mean", params), greedy, set(), kib).token_ids
                agree.append(next((i for i, (a, b) in enumerate(zip(toks, ref_tokens)) if a != b), len(ref_tokens)))
            out["agreement"].append({"scorer": scorer, "tokens_before_divergence": agree,
                                     "mean": sum(agree) / len(agree)})
            echo(f"{scorer:>12} agreement with full: {agree} (mean {sum(agree) / len(agree):.1f} of {greedy.max_new_tokens})")
        out["agreement_seconds"] = time.perf_counter() - t0
    return out
