"""Per-arm summaries and the report's diagnostics (protocol section 6).

* `summarize_run`: accuracy with a clustered 95% CI, measured cache, length, truncation, fidelity;
* `effect_vs_n`: the paired test on nested random subsets of problems (a gain that shrinks with n);
* `aggregate_trace`: per-step cache length across records on a common step grid;
* `accounting_effects`: the iso-cache check (the same comparison under `prefill` and `mean`);
* `proxy_agreement`: fidelity proxies beside accuracy, with their Spearman correlation;
* `sceptic_diagnostics`: what a sceptical reader asks of an arm (acc_strict, truncated and looping
  answers, whether and how much of each answer the mechanism acted on, a guessing baseline, the
  prompt's retention), each definition in its function's docstring and in docs/statistics.md.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from protocol import stats
from protocol.report_fidelity import noise_floor
from protocol.runs import Run, correct

# A looping answer: its last LOOP_TAIL tokens repeat with a period of at most LOOP_PERIOD tokens
# (so at least three times over), the degenerate repetition a broken cache produces.
LOOP_TAIL = 192
LOOP_PERIOD = 64
# The guessing baseline's small integers: a gold of 0..6 is what a model guesses right by chance.
SMALL_GOLD = re.compile(r"[0-6]")


def _mean(values) -> float:
    vals = [float(v) for v in values if v is not None]
    return float(np.mean(vals)) if vals else float("nan")


def summarize_run(run: Run) -> dict:
    """Accuracy (with a clustered 95% normal CI), cache, length and truncation of one run."""
    recs = run.records
    problems = sorted({str(r["problem_id"]) for r in recs})
    index = {p: i for i, p in enumerate(problems)}
    ok = np.array([correct(r) for r in recs], dtype=float)
    pid = np.array([index[str(r["problem_id"])] for r in recs])
    per_problem = np.bincount(pid, weights=ok) / np.bincount(pid)  # (n,) problem accuracies
    acc = float(ok.mean()) if ok.size else float("nan")
    se = float(per_problem.std(ddof=1) / np.sqrt(per_problem.size)) if per_problem.size > 1 else 0.0
    fid = [r["fidelity"] for r in recs if isinstance(r.get("fidelity"), dict)]
    peaks = [r.get("cache_peak_tokens") for r in recs if r.get("cache_peak_tokens") is not None]
    return {
        "run_id": run.run_id, "label": run.label, "model": run.model, "dataset": run.dataset,
        "model_quant": run.config.get("model_quant"), "code_version": run.meta.get("code_version"),
        "budget": run.budget, "budget_kib": run.config.get("budget_kib"),  # a --budget-bytes arm: labelled by KiB
        "scorer": run.scorer, "prompt": run.prompt_rule,
        "accounting": run.accounting, "split": run.split, "n_problems": len(problems),
        "n_records": len(recs), "accuracy": acc, "acc_ci95_lo": acc - 1.96 * se,
        "acc_ci95_hi": acc + 1.96 * se,
        "cache_mean_tokens": _mean(r.get("cache_mean_tokens") for r in recs),
        "cache_peak_tokens": float(max(peaks)) if peaks else float("nan"),
        "kib_per_token": _mean(r.get("kib_per_token") for r in recs),
        "cache_mean_kib": _mean(r.get("cache_mean_kib") for r in recs),
        # this engine's buffer slots, holes included (older records lack it: NaN, not measured)
        "cache_mean_buffer_tokens": _mean(r.get("cache_mean_buffer_tokens") for r in recs),
        "mean_output_tokens": _mean(r.get("output_tokens") for r in recs),
        "truncation_rate": (float(np.mean([r.get("finish_reason") == "length" for r in recs]))
                            if recs else float("nan")),
        "budget_exceeded": int(sum(bool(r.get("budget_exceeded")) for r in recs)),
        "ungradable": int(sum(r.get("verdict") is None for r in recs)),
        "kl_mean": _mean(f.get("kl_mean") for f in fid) if fid else float("nan"),
        "top1_agreement": _mean(f.get("top1_agreement") for f in fid) if fid else float("nan"),
        "kl_max": _mean(f.get("kl_max") for f in fid) if fid else float("nan"),
        # first step whose top-1 differs from the full cache; a record that never diverges counts
        # as its length (so the median is not biased towards the records that did diverge)
        "first_divergence_median": (float(np.median([f["first_divergence_step"] if f.get("first_divergence_step")
                                                     is not None else f.get("steps", 0) for f in fid]))
                                    if fid else float("nan")),
        "fidelity_records": len(fid),
        **noise_floor(recs),  # what never-compacted records diverge by: no retention's doing
        "tokens_per_second": _mean(r.get("tokens_per_second") for r in recs),
        "plan_hash": run.plan_hash, "code_version": run.meta.get("code_version"),
        "model_revision": run.config.get("model_revision"), "path": str(run.path),
    }


def subset_sizes(n: int, start: int = 25) -> list[int]:
    """25, 50, 100, ... (doubling) below n, then n itself."""
    sizes, s = [], start
    while s < n:
        sizes.append(s)
        s *= 2
    return sizes + [n]


def effect_vs_n(data: stats.PairedData, *, seed: int, boot: int) -> list[dict]:
    """Paired test on nested random subsets of the problems (one seeded permutation; the first
    25, 50, ... problems), so a gain that shrinks with n is visible."""
    order = np.random.default_rng(seed).permutation(data.n)
    rows = []
    for size in subset_sizes(data.n):
        idx = np.sort(order[:size])
        if size < 2:
            continue
        sub = stats.PairedData(data.clusters[idx], data.a[idx], data.b[idx], data.k)
        r = stats.paired_test(sub, boot=boot, boot_max=boot, seed=seed)
        rows.append({"n": size, "estimate": r.estimate, "se": r.se, "ci95_lo": r.ci95[0],
                     "ci95_hi": r.ci95[1], "p_bootstrap": r.p_bootstrap, "p_z": r.p_z})
    return rows


def aggregate_trace(trace: list, points: int = 200) -> dict | None:
    """Per-step cache length across records on a common step grid.

    trace: lines {"steps": (T_r,), "tokens": (T_r,)}; returns grid (points,), mean/lo/hi (points,)
    (mean and 10th/90th percentiles over records still decoding at that step), alive (points,).
    """
    series = [(np.asarray(t["steps"], float), np.asarray(t["tokens"], float)) for t in trace
              if t.get("steps") and len(t["steps"]) == len(t.get("tokens", []))]
    if not series:
        return None
    grid = np.linspace(0.0, max(s[-1] for s, _ in series), points)
    mat = np.full((len(series), points), np.nan)
    for i, (s, tok) in enumerate(series):
        inside = (grid >= s[0]) & (grid <= s[-1])  # a finished record has no cache any more
        mat[i, inside] = np.interp(grid[inside], s, tok)
    alive = (~np.isnan(mat)).sum(axis=0)
    keep = alive > 0
    mat, alive = mat[:, keep], alive[keep]
    return {"grid": grid[keep].tolist(), "mean": (np.nansum(mat, axis=0) / alive).tolist(),
            "lo": _column_quantile(mat, alive, 0.1).tolist(),
            "hi": _column_quantile(mat, alive, 0.9).tolist(), "alive": alive.tolist()}


def _column_quantile(mat: np.ndarray, alive: np.ndarray, q: float) -> np.ndarray:
    """Linear-interpolated q-quantile of each column of (R, P) `mat` over its non-NaN entries
    (`alive` (P,) of them); vectorised because np.nanpercentile loops over columns in Python."""
    srt = np.sort(mat, axis=0)  # NaN sorts last
    pos = q * (alive - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, alive - 1)
    cols = np.arange(mat.shape[1])
    return srt[lo, cols] + (pos - lo) * (srt[hi, cols] - srt[lo, cols])


def accounting_effects(rows: list[dict]) -> list[dict]:
    """Iso-cache diagnostic: the same (cell, treatment, baseline) under `prefill` and `mean`
    accounting side by side. A gain that holds only under `prefill` came from a larger mean cache."""
    groups: dict = {}
    for row in rows:
        key = (row["model"], row["budget"], row["treatment"], row["baseline"])
        groups.setdefault(key, {})[row["accounting"]] = row
    out = []
    for (model, budget, treat, base), modes in groups.items():
        if "prefill" in modes and "mean" in modes:
            pre, mean = modes["prefill"], modes["mean"]
            out.append({
                "model": model, "budget": budget, "treatment": treat, "baseline": base,
                "delta_prefill_pp": pre["delta_pp"], "ci95_prefill": [pre["ci95_lo_pp"], pre["ci95_hi_pp"]],
                "p_prefill": pre["p_bootstrap"], "cache_prefill": pre["t_cache_mean_tokens"],
                "exceeded_prefill": pre["t_budget_exceeded"],
                "delta_mean_pp": mean["delta_pp"], "ci95_mean": [mean["ci95_lo_pp"], mean["ci95_hi_pp"]],
                "p_mean": mean["p_bootstrap"], "cache_mean": mean["t_cache_mean_tokens"],
                "exceeded_mean": mean["t_budget_exceeded"],
                "gain_vanishes": bool(pre["verdict"] == "better" and mean["verdict"] != "better"),
            })
    return out


EXACT_SPEARMAN_MAX_N = 8  # 8! = 40,320 orderings: enumerated at once


def spearman(x, y) -> tuple[float, float]:
    """Spearman's rho and its two-sided p. Up to `EXACT_SPEARMAN_MAX_N` points p is exact (every
    ordering of y's ranks enumerated): the t approximation scipy uses is meaningless that small
    (three points in the same order give p = 0 instead of 1/3)."""
    # deferred: scipy.stats adds ~0.3 s to CLI start-up (the CLI imports this module)
    from scipy.stats import rankdata, spearmanr

    rho, p = spearmanr(x, y)
    n = len(x)
    if n <= EXACT_SPEARMAN_MAX_N:
        rx, ry = rankdata(x), rankdata(y)
        perms = np.array(list(itertools.permutations(ry)))  # [n!, n]
        cx = rx - rx.mean()
        cp = perms - perms.mean(axis=1, keepdims=True)
        r = (cp @ cx) / (np.sqrt((cp ** 2).sum(axis=1)) * np.sqrt((cx ** 2).sum()))
        p = float(np.mean(np.abs(r) >= abs(rho) - 1e-12))
    return float(rho), float(p)


def proxy_agreement(arms: list[dict]) -> tuple[list[dict], list[dict]]:
    """Proxy-drift diagnostic: mean KL / top-1 agreement per arm beside accuracy, and the Spearman
    correlation of each proxy with accuracy across configurations (needs >= 3 arms with fidelity)."""
    rows = [{"label": a["label"], "model": a["model"], "budget": a["budget"],
             "accounting": a["accounting"], "accuracy": a["accuracy"], "kl_mean": a["kl_mean"],
             "top1_agreement": a["top1_agreement"], "fidelity_records": a["fidelity_records"]}
            for a in arms if a["fidelity_records"] > 0]
    corr = []
    for proxy in ("kl_mean", "top1_agreement"):
        pts = [(r[proxy], r["accuracy"]) for r in rows if np.isfinite(r[proxy])]
        if len(pts) >= 3:
            x, y = np.array(pts).T
            if np.ptp(x) > 0 and np.ptp(y) > 0:
                rho, p = spearman(x, y)
                corr.append({"proxy": proxy, "n_configs": len(pts), "spearman_rho": rho, "p": p,
                             "p_method": "exact" if len(pts) <= EXACT_SPEARMAN_MAX_N else "t approximation"})
            else:
                corr.append({"proxy": proxy, "n_configs": len(pts), "spearman_rho": float("nan"),
                             "p": float("nan")})
    return rows, corr


def is_looping(tokens, tail: int = LOOP_TAIL, max_period: int = LOOP_PERIOD) -> bool:
    """Whether the last `tail` of `tokens` (ids, or the characters of a text) is periodic with a period
    of at most `max_period`; an answer shorter than `tail` is not counted as looping."""
    seq = np.asarray([ord(c) for c in tokens] if isinstance(tokens, str) else list(tokens), dtype=np.int64)
    if seq.size < tail:
        return False
    t = seq[-tail:]
    return any(bool((t[p:] == t[:-p]).all()) for p in range(1, max_period + 1))


def small_gold(gold) -> bool:
    """A gold answer that is a small integer 0..6 (surrounding spaces and `$` ignored)."""
    return gold is not None and bool(SMALL_GOLD.fullmatch(str(gold).strip().strip("$").strip()))


def first_compaction_step(run: Run, rec: dict, trace: dict | None) -> int | None:
    """Output tokens generated when the record's first compaction ran (0: at prefill); None when it
    never compacted or the step cannot be known. From the record's cache trace when there is one;
    else from the fixed cadence of the run's configuration (`nominal_b` + `interval`, the prompt on
    top with `protect_prompt`): a prompt longer than `b` compacts at prefill, otherwise the first
    compaction comes when prompt + output reach `b + N`. Another cadence without a trace: None."""
    if not rec.get("compactions"):
        return None
    if trace is not None and trace.get("compactions"):
        return int(trace["compactions"][0]["step"])
    cfg = run.config
    b, n, prompt = cfg.get("nominal_b"), cfg.get("interval"), rec.get("prompt_tokens")
    if cfg.get("cadence") is not None or b is None or n is None or prompt is None:
        return None
    if cfg.get("protect_prompt"):
        return int(b + n)
    return 0 if prompt > b else int(b + n - prompt)


def sceptic_diagnostics(run: Run) -> dict:
    """One arm's diagnostics (docs/statistics.md, "Diagnostics"), shares of its records:

    * `acc_strict`: correct and finished within the token limit (`finish_reason` not `length`);
    * `truncated_share`, `looping_share` (`is_looping` on the output ids, else the text);
    * `compacted_share`: records with at least one compaction (None without `compactions`);
    * `after_compaction_share`: mean over records of the share of the answer written after its first
      compaction (0 for a record that never compacted; None when some compacted record's step is
      unknown, `first_compaction_step`);
    * the guessing baseline: `small_gold_correct_share`, the share of correct records whose gold is
      0..6, beside `small_gold_problem_share`, the share of the run's problems whose gold is;
    * the prompt: the arm's rule, `prompt_evicted_share` (records whose prompt lost a position from
      some group and head) and `prompt_held_final` (mean share of the prompt held at the end), both
      from cache traces (None without them)."""
    recs = run.records
    traces = {(str(t.get("problem_id")), int(t.get("sample", 0))): t for t in (run.trace or [])}
    n = len(recs)
    ok = [bool(correct(r)) for r in recs]
    share = (lambda xs: float(np.mean(xs)) if len(xs) else float("nan"))  # noqa: E731

    after, known = [], True
    for r in recs:
        out = int(r.get("output_tokens") or 0)
        step = first_compaction_step(run, r, traces.get((str(r["problem_id"]), int(r["sample"]))))
        if r.get("compactions") and step is None:
            known = False
        after.append(0.0 if step is None or out == 0 else max(out - step, 0) / out)
    golds = {str(r["problem_id"]): r.get("gold") for r in recs}
    right = [r for r, c in zip(recs, ok) if c]
    evicted = [r["prompt_evicted_step"] is not None for r in recs if "prompt_evicted_step" in r]
    held = [r["prompt_held_final"] for r in recs if r.get("prompt_held_final") is not None]
    return {
        "label": run.label, "model": run.model, "budget": run.budget, "split": run.split, "records": n,
        "accuracy": share(ok),
        "acc_strict": share([c and r.get("finish_reason") != "length" for r, c in zip(recs, ok)]),
        "truncated_share": share([r.get("finish_reason") == "length" for r in recs]),
        "looping_share": share([is_looping(r.get("output_token_ids") or r.get("text") or "") for r in recs]),
        "compacted_share": (share([bool(r.get("compactions")) for r in recs])
                            if all("compactions" in r for r in recs) else None),
        "after_compaction_share": share(after) if known else None,
        "small_gold_correct_share": share([small_gold(r.get("gold")) for r in right]) if right else None,
        "small_gold_problem_share": share([small_gold(g) for g in golds.values()]),
        "prompt": run.prompt_rule,
        "prompt_evicted_share": share(evicted) if evicted else None,
        "prompt_held_final": share(held) if held else None,
    }


def sceptic_lines(rows: list[dict]) -> list[str]:
    """The terminal's lines of `sceptic_diagnostics` rows, one per arm."""
    pct = lambda x: "-" if x is None or x != x else f"{100 * x:.1f}%"  # noqa: E731
    return [f"diagnostics {r['label']} ({r['model']}/{r['budget']}/{r['split']}): acc {pct(r['accuracy'])}, "
            f"acc_strict {pct(r['acc_strict'])}, truncated {pct(r['truncated_share'])}, looping "
            f"{pct(r['looping_share'])}, compacted {pct(r['compacted_share'])}, answer after 1st compaction "
            f"{pct(r['after_compaction_share'])}; golds 0..6: {pct(r['small_gold_correct_share'])} of correct answers, "
            f"{pct(r['small_gold_problem_share'])} of problems; prompt {r['prompt']}, evicted in "
            f"{pct(r['prompt_evicted_share'])}, held at end {pct(r['prompt_held_final'])}" for r in rows]

