"""Paired test on the fidelity proxy: an exploratory secondary endpoint.

When a model scores 0% on MATH (the embedded demo model does), accuracy cannot separate two arms;
what the runs still measure is how closely each arm's retained cache tracks the full cache along its
own tokens (records written with `--fidelity`). Per record two figures:

* `kl_mean`: mean over decode steps of KL(p_full || p_retained), lower is better;
* `first_divergence_step`: the first step whose top-1 token differs from the full cache's, higher
  is better; a record that never diverges counts as its number of steps (a lower bound: censored).

Records of the treatment and baseline arms are paired by (problem_id, sample); the paired difference
`T - B` is averaged per problem (the cluster), and the mean over problems is tested with the same
null-centred cluster bootstrap as the primary endpoint (problems resampled with replacement,
two-sided p = (1 + #{|d* - d| >= |d|}) / (B + 1), percentile 95% CI), here on continuous values.
It is labelled exploratory: no plan fixes it, no Bonferroni family includes it.

**Noise floor.** A record whose cache never compacted (`compactions` 0) holds what the full cache
holds, yet in bfloat16 its decode can still leave the full cache's: a row's attention depends on
the width of the buffers it is computed over, and other rows of its batch compact. So the figures
above carry a floor that is no retention's doing. `noise_floor` measures it on each arm's own
never-compacted records (their KL, and how many diverged at all), and every fidelity line and the
arm table print it beside the figures.
"""

from __future__ import annotations

import numpy as np

from protocol.errors import ProtocolError

METRICS = ("kl_mean", "first_divergence_step")
LABEL = "exploratory secondary endpoint (fidelity proxy)"


def record_value(rec: dict, metric: str) -> float | None:
    fid = rec.get("fidelity")
    if not isinstance(fid, dict):
        return None
    if metric == "first_divergence_step":
        v = fid.get("first_divergence_step")
        return float(fid.get("steps", 0)) if v is None else float(v)
    v = fid.get(metric)
    return None if v is None else float(v)


def noise_floor(records: list[dict]) -> dict:
    """The fidelity figures of the records whose cache never compacted (`compactions` 0): how many
    (`floor_records`), their mean `kl_mean` (`floor_kl_mean`, NaN when none), how many diverged
    from the full cache's top-1 at all (`floor_diverged`) and the earliest step one did
    (`floor_first_divergence`, None when none)."""
    fid = [r["fidelity"] for r in records
           if isinstance(r.get("fidelity"), dict) and r.get("compactions") == 0]
    kls = [float(f["kl_mean"]) for f in fid if f.get("kl_mean") is not None]
    steps = [int(f["first_divergence_step"]) for f in fid if f.get("first_divergence_step") is not None]
    return {"floor_records": len(fid), "floor_kl_mean": float(np.mean(kls)) if kls else float("nan"),
            "floor_diverged": len(steps), "floor_first_divergence": min(steps) if steps else None}


def floor_text(f: dict) -> str:
    """`noise floor (n never-compacted records): KL x, d diverged (first at step s)`."""
    if not f.get("floor_records"):
        return "noise floor: no never-compacted record with fidelity figures (not measured)"
    first = f" (earliest at step {f['floor_first_divergence']})" if f.get("floor_first_divergence") is not None else ""
    return (f"noise floor ({f['floor_records']} never-compacted record(s)): KL {f['floor_kl_mean']:.3g}, "
            f"{f['floor_diverged']} of {f['floor_records']} diverged from the full cache{first}")


def floor_lines(arms: list[dict]) -> list[str]:
    """One line per arm with fidelity figures: its noise floor beside its KL and first divergence."""
    return [f"fidelity of {a['label']} ({a['model']}/{a['budget']}): KL {a['kl_mean']:.4g}, first divergence "
            f"median {a['first_divergence_median']:.0f}; {floor_text(a)}"
            for a in arms if a.get("fidelity_records")]


def per_problem_differences(t_records: list[dict], b_records: list[dict], metric: str) -> tuple[list, np.ndarray]:
    """(problem ids, `[n]` mean over each problem's samples of T - B) over the pairs both arms have."""
    b_by = {(r["problem_id"], r["sample"]): r for r in b_records}
    diffs: dict[str, list[float]] = {}
    for r in t_records:
        other = b_by.get((r["problem_id"], r["sample"]))
        if other is None:
            continue
        vt, vb = record_value(r, metric), record_value(other, metric)
        if vt is None or vb is None:
            continue
        diffs.setdefault(r["problem_id"], []).append(vt - vb)
    ids = sorted(diffs)
    return ids, np.array([np.mean(diffs[i]) for i in ids], dtype=np.float64)


def cluster_bootstrap(d: np.ndarray, *, boot: int, seed: int) -> dict:
    """Null-centred cluster bootstrap of the mean of per-cluster values `d` `[n]`: estimate, two-sided
    p and percentile 95% CI."""
    n = d.size
    if n == 0:
        raise ProtocolError("no paired records with fidelity figures")
    est = float(d.mean())
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    means = np.empty(boot)
    chunk = max(1, 2_000_000 // max(n, 1))
    for s in range(0, boot, chunk):
        m = min(chunk, boot - s)
        means[s:s + m] = d[rng.integers(0, n, size=(m, n))].mean(axis=1)
    extreme = np.abs(means - est) >= abs(est) - 1e-12 * max(1.0, abs(est))
    p = 1.0 if est == 0 else float((1 + extreme.sum()) / (boot + 1))
    lo, hi = np.quantile(means, [0.025, 0.975])
    return {"estimate": est, "p_bootstrap": min(1.0, p), "ci95_lo": float(lo), "ci95_hi": float(hi), "n": int(n),
            "boot": boot, "seed": seed}


def fidelity_comparisons(pairs, *, boot: int = 10_000, seed: int = 0) -> list[dict]:
    """One row per (treatment, baseline) pair of report `Run`s and fidelity metric, for the pairs
    whose records both carry fidelity figures."""
    rows = []
    for t, b in pairs:
        for metric in METRICS:
            ids, d = per_problem_differences(t.records, b.records, metric)
            if not ids:
                continue
            res = cluster_bootstrap(d, boot=boot, seed=seed)
            mean_t = np.mean([v for v in (record_value(r, metric) for r in t.records) if v is not None])
            mean_b = np.mean([v for v in (record_value(r, metric) for r in b.records) if v is not None])
            rows.append({"model": t.model, "budget": t.budget, "treatment": t.label, "baseline": b.label,
                         "metric": metric, "mean_treatment": float(mean_t), "mean_baseline": float(mean_b),
                         "endpoint": LABEL, **res, **noise_floor(t.records)})
    return rows


def summary_lines(rows: list[dict]) -> list[str]:
    """Terminal lines: one per comparison and metric."""
    out = []
    for r in rows:
        better = "lower" if r["metric"] == "kl_mean" else "higher"
        out.append(f"fidelity ({LABEL}) {r['model']}/{r['budget']} {r['treatment']} vs {r['baseline']}: "
                   f"{r['metric']} {r['mean_treatment']:.4g} vs {r['mean_baseline']:.4g}, paired Δ "
                   f"{r['estimate']:+.4g} [{r['ci95_lo']:+.4g}, {r['ci95_hi']:+.4g}], p = {r['p_bootstrap']:.3g} "
                   f"({better} is better; n = {r['n']} problems, cluster bootstrap B={r['boot']}); "
                   f"{r['treatment']}'s {floor_text(r)}")
    return out
