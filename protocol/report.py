"""Reports over run directories (protocol section 6).

Input: run directories (docs/records.md): `config.json`, `records.jsonl`, optionally `trace.jsonl`
and, for confirm runs, `confirm.json`. Records of two runs are paired by (problem_id, sample).

* cell   = (model, budget) of a run's configuration;
* arm    = one run; its label is the scorer plus the parameters that tell runs of that scorer apart;
* baseline = the run named by `baseline` (run id, directory or scorer name), else the run whose
  scorer is `triattention`, else the first run given. Its scorer and parameters define the baseline
  arm in every cell; when a cell holds several baseline runs (accounting modes), a treatment is
  compared with the one of its own accounting mode. Every other run of the cell is a treatment.

Outputs (`write_report`): report.csv (one row per comparison), arms.csv, report.tex (booktabs),
report.json, diagnostics CSVs and PNG figures (`protocol.report_figures`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protocol import shards, stats
from protocol.errors import ProtocolError
from protocol.io import load_json_object, read_jsonl, sha256_file
from protocol.ledger import Registry, read_confirmation

BASELINE_SCORER = "triattention"
SUBSET_BOOT = 20_000  # resamples per nested-subset test: a diagnostic, not a decision


# --------------------------------------------------------------------------------------------------
# Loading


@dataclass
class Run:
    """One run directory: `meta` is config.json, `config` its inner configuration."""

    path: Path
    meta: dict
    config: dict
    records: list
    confirm: dict | None = None
    trace: list | None = None
    warnings: list = field(default_factory=list)
    label: str = ""

    @property
    def run_id(self) -> str:
        return str(self.meta.get("run_id") or self.path.name)

    @property
    def model(self) -> str:
        return str(self.config.get("model"))

    @property
    def budget(self):
        return self.config.get("budget")

    @property
    def scorer(self) -> str:
        return str(self.config.get("scorer"))

    @property
    def accounting(self) -> str:
        return str(self.config.get("accounting") or "mean")

    @property
    def cell(self) -> tuple:
        return (self.model, self.budget)

    @property
    def signature(self) -> str:
        """Scorer and parameters: what makes two runs the same arm in different cells."""
        params = self.config.get("scorer_params") or {}
        engine = self.config.get("engine")  # a run of another engine (run --engine) is another arm
        prompt = "+protect-prompt" if self.config.get("protect_prompt") else ""  # the reference's prompt rule
        return self.scorer + json.dumps(params, sort_keys=True) + prompt + (f"@{engine}" if engine else "")

    @property
    def plan_hash(self) -> str | None:
        return (self.meta.get("plan_hash") or self.config.get("plan_hash")
                or (self.confirm or {}).get("plan_hash"))


def _read_jsonl(path: Path, what: str) -> tuple[list, list]:
    """Parse a JSONL file; a half-written last line (a run killed mid-write) is dropped with a
    warning, any other unreadable line is an error. Returns (objects, warnings)."""
    read = read_jsonl(path, what)
    warnings = [f"{path}: dropped a half-written last line"] if read.partial_tail else []
    return read.objects, warnings


def _lazy_grade():
    from protocol.grading import grade

    return grade


def load_run(path, grade=None, with_trace: bool = False) -> Run:
    """Read a run directory. Records without a `verdict` key are graded with
    `grade(text, gold)` (default: protocol.grading.grade); a null verdict stays null (= wrong)."""
    path = Path(path)
    cfg_path, rec_paths = path / "config.json", shards.record_files(path)  # records.jsonl, or shard files
    if not cfg_path.is_file() or not rec_paths:
        raise ProtocolError(f"{path} is not a run directory (needs config.json and records.jsonl)")
    try:
        meta = load_json_object(cfg_path, "run configuration")
    except ProtocolError as exc:
        raise ProtocolError(f"unreadable run configuration: {exc}") from None
    if not isinstance(meta.get("config"), dict):
        raise ProtocolError(f"{cfg_path}: no 'config' object")
    records, warnings = [], [f"{path}: shard {s} has no records yet" for s in shards.missing_shards(path)]
    for rec_path in rec_paths:
        recs, w = _read_jsonl(rec_path, "record")
        records += recs
        warnings += w
    seen = set()
    for rec in records:
        if "problem_id" not in rec or "sample" not in rec:
            raise ProtocolError(f"{path}: a record lacks problem_id/sample")
        key = (str(rec["problem_id"]), int(rec["sample"]))
        if key in seen:
            raise ProtocolError(f"{path}: duplicated record {key}")
        seen.add(key)
    ungraded = [r for r in records if "verdict" not in r]
    if ungraded:
        grade = grade or _lazy_grade()
        for rec in ungraded:
            text, gold = rec.get("text"), rec.get("gold")
            # No text (a failed generation) or no gold answer cannot be right: null = wrong.
            g = grade(text, gold) if text is not None and gold is not None else None
            rec["verdict"] = None if g is None else g.verdict
            if g is not None:
                rec.setdefault("extracted", g.extracted)
                rec.setdefault("reason", g.reason)
                rec.setdefault("rule", g.rule)
    confirm = None
    if (path / "confirm.json").is_file():
        confirm = load_json_object(path / "confirm.json", "confirmation sidecar")
    trace = None
    if with_trace and shards.trace_files(path):
        trace = []
        for trace_path in shards.trace_files(path):
            t, w = _read_jsonl(trace_path, "trace")
            trace += t
            warnings += w
    return Run(path=path, meta=meta, config=meta["config"], records=records, confirm=confirm,
               trace=trace, warnings=warnings)


def find_run_dirs(paths) -> list[Path]:
    """Expand each path: a run directory itself, or a folder searched for run directories."""
    out = []
    for p in map(Path, paths):
        if (p / "config.json").is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(q.parent for q in p.rglob("config.json") if shards.record_files(q.parent))
            if not found:
                raise ProtocolError(f"{p}: no run directories (config.json + records.jsonl) below it")
            out += found
        else:
            raise ProtocolError(f"{p}: no such run directory")
    unique = list(dict.fromkeys(q.resolve() for q in out))
    return unique


def correct(rec: dict) -> int:
    """1 only for a verdict of True; failed, ungradable (null) or wrong generations are 0."""
    return 1 if rec.get("verdict") is True or rec.get("verdict") == 1 else 0


def pair_runs(treatment: Run, baseline: Run) -> stats.PairedData:
    """Pair two runs by (problem_id, sample) into per-problem sums; unpaired records are an error."""
    kt = {(str(r["problem_id"]), int(r["sample"])): r for r in treatment.records}
    kb = {(str(r["problem_id"]), int(r["sample"])): r for r in baseline.records}
    only_t, only_b = sorted(kt.keys() - kb.keys()), sorted(kb.keys() - kt.keys())
    if only_t or only_b:
        example = (only_t or only_b)[0]
        raise ProtocolError(
            f"runs {treatment.run_id} and {baseline.run_id} are not paired: {len(only_t)} record(s) "
            f"only in the first, {len(only_b)} only in the second (e.g. problem {example[0]!r}, "
            f"sample {example[1]})")
    keys = sorted(kt)
    for key in keys:
        st, sb = kt[key].get("seed"), kb[key].get("seed")
        if st is not None and sb is not None and st != sb:
            raise ProtocolError(f"runs {treatment.run_id} and {baseline.run_id} used different "
                                f"seeds for {key} ({st} vs {sb}): arms are not paired")
    return stats.paired_from_long([k[0] for k in keys], [correct(kt[k]) for k in keys],
                                  [correct(kb[k]) for k in keys], [k[1] for k in keys])


# --------------------------------------------------------------------------------------------------
# Per-arm summaries


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
        "run_id": run.run_id, "label": run.label, "model": run.model, "budget": run.budget,
        "scorer": run.scorer, "accounting": run.accounting, "n_problems": len(problems),
        "n_records": len(recs), "accuracy": acc, "acc_ci95_lo": acc - 1.96 * se,
        "acc_ci95_hi": acc + 1.96 * se,
        "cache_mean_tokens": _mean(r.get("cache_mean_tokens") for r in recs),
        "cache_peak_tokens": float(max(peaks)) if peaks else float("nan"),
        "kib_per_token": _mean(r.get("kib_per_token") for r in recs),
        "cache_mean_kib": _mean(r.get("cache_mean_kib") for r in recs),
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
        "tokens_per_second": _mean(r.get("tokens_per_second") for r in recs),
        "plan_hash": run.plan_hash, "code_version": run.meta.get("code_version"),
        "model_revision": run.config.get("model_revision"), "path": str(run.path),
    }


def assign_labels(runs: list[Run]) -> None:
    """Label = scorer + the scorer parameters that differ between runs of that scorer; a config
    hash suffix only if two runs of one cell would still share label and accounting mode."""
    by_scorer: dict = {}
    for run in runs:
        by_scorer.setdefault(run.scorer, []).append(run.config.get("scorer_params") or {})
    for run in runs:
        params = run.config.get("scorer_params") or {}
        siblings = by_scorer[run.scorer]
        varying = sorted(k for k in {k for p in siblings for k in p}
                         if len({json.dumps(p.get(k), sort_keys=True) for p in siblings}) > 1)
        extra = ",".join(f"{k}={params.get(k)}" for k in varying)
        run.label = f"{run.scorer}[{extra}]" if extra else run.scorer
        if run.config.get("protect_prompt"):  # the report says which prompt rule ran
            run.label += "+pp"
        if run.config.get("engine"):
            run.label += f"@{run.config['engine']}"
    seen: dict = {}
    for run in runs:
        seen.setdefault((run.cell, run.label, run.accounting), []).append(run)
    for group in seen.values():
        if len(group) > 1:
            for run in group:
                run.label += f"#{str(run.meta.get('config_hash') or run.run_id)[:6]}"


def _budget_key(b):
    return (b is None, b if b is not None else 0)


def _match_baseline(runs: list[Run], baseline: str | None) -> Run:
    if baseline is None:
        plain = [run for run in runs if getattr(run, "label", None) == BASELINE_SCORER]
        for run in plain + runs:
            if run.scorer == BASELINE_SCORER:
                return run
        return runs[0]
    target = Path(baseline)
    for run in runs:
        same_dir = target.exists() and run.path.resolve() == target.resolve()
        if baseline in (run.run_id, run.path.name) or same_dir:
            return run
    # A label (e.g. `triattention+pp`) names one variant; a bare scorer name prefers the run whose
    # label is just that name (the default rule and parameters) over its variants.
    named = [run for run in runs if getattr(run, "label", None) == baseline]
    named = named or [run for run in runs if run.scorer == baseline]
    if named:
        return named[0]
    raise ProtocolError(f"--baseline {baseline!r} matches no run id, run directory, label or scorer")


def plan_comparisons(runs: list[Run], baseline: str | None = None) -> tuple[list, list]:
    """Pairs (treatment, baseline) per cell, and notes about cells without a baseline run.

    A run without a budget (`full`, no eviction) is a reference for every budget of its model: it
    joins each of that model's cells as a possible baseline and is never a treatment there.
    """
    ref = _match_baseline(runs, baseline)
    budgeted = {r.model for r in runs if r.budget is not None}
    unbudgeted = [r for r in runs if r.budget is None and r.model in budgeted]
    cells: dict = {}
    for run in runs:
        if run not in unbudgeted:
            cells.setdefault(run.cell, []).append(run)
    pairs, notes = [], []
    models = list(dict.fromkeys(r.model for r in runs))
    for key in sorted(cells, key=lambda c: (models.index(c[0]), _budget_key(c[1]))):
        members = cells[key]
        shared = [r for r in unbudgeted if r.model == key[0]]
        bases = [r for r in members + shared if r.signature == ref.signature]
        if not bases:
            notes.append(f"cell {key[0]} / budget {key[1]}: no {ref.label} baseline run; not compared")
            continue
        bases.sort(key=lambda r: r.accounting != "mean")  # a `mean` run is the default partner
        for run in sorted(members, key=lambda r: (r.label, r.accounting != "mean", r.accounting)):
            if run.signature == ref.signature:
                continue
            partner = next((b for b in bases if b.accounting == run.accounting), bases[0])
            pairs.append((run, partner))
    return pairs, notes


# --------------------------------------------------------------------------------------------------
# The report


@dataclass
class Report:
    comparisons: list   # dict per (treatment, baseline) pair: the main table
    arms: list          # dict per run
    accounting: list    # iso-cache diagnostic rows
    subsets: list       # effect vs n rows
    proxy: list         # per-arm proxy rows
    proxy_corr: list    # Spearman rows
    traces: dict        # run label -> aggregated trace
    provenance: dict    # plan hashes, ledger, deviations
    notes: list
    settings: dict
    fidelity: list = field(default_factory=list)  # exploratory paired test on the fidelity proxy

    def to_dict(self) -> dict:
        return {"settings": self.settings, "comparisons": self.comparisons, "arms": self.arms,
                "fidelity_exploratory": self.fidelity,
                "diagnostics": {"accounting": self.accounting, "subsets": self.subsets,
                                "proxy": self.proxy, "proxy_correlation": self.proxy_corr},
                "provenance": self.provenance, "notes": self.notes}


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


def _find_confirm_dirs(runs: list[Run], explicit) -> list[Path]:
    dirs = [Path(d) for d in explicit or []]
    for run in runs:
        if run.plan_hash is None:
            continue
        for parent in list(run.path.resolve().parents)[:4]:
            if (parent / "ledger.jsonl").is_file() or (parent / "deviations.jsonl").is_file():
                dirs.append(parent)
                break
    return list(dict.fromkeys(d.resolve() for d in dirs))


def is_confirm_run(run: Run) -> bool:
    """A run on the confirm split (or made for a plan): its numbers count only if confirmed."""
    return run.config.get("split") == "confirm" or run.plan_hash is not None


def confirmation_status(run: Run, registry: Registry) -> str | None:
    """None when the run is an arm of a cell confirmed in the registry with exactly these records;
    else why not (printed as UNCONFIRMED)."""
    h = run.plan_hash
    if h is None:
        return "confirm-split run without a plan hash"
    if registry.key(h) is None:
        return f"plan {h[:12]} is not in the registry {registry.root}: cannot verify"
    records = sha256_file(run.path / "records.jsonl")
    config_hash = run.meta.get("config_hash")
    changed = False
    for entry in registry.ledger(h).entries():
        for info in (entry.get("runs") or {}).values():
            if info.get("config_hash") == config_hash and info.get("run_id") == run.meta.get("run_id"):
                if info.get("records_sha256") == records:
                    return None
                changed = True
    if changed:
        return "records changed since confirmation"
    return f"no ledger entry of plan {h[:12]} for this run"


def provenance(runs: list[Run], confirm_dirs, registry: Registry | None = None) -> dict:
    """Plan hashes of the runs, verified ledgers and deviation logs of their confirm directories,
    and, per confirm-split run, why it is not a confirmed result (`unconfirmed`: run id -> reason)."""
    registry = registry or Registry()
    out = {"plan_hashes": sorted({r.plan_hash for r in runs if r.plan_hash}), "confirm_dirs": [],
           "deviations": [], "ledger_cells": [], "warnings": [], "plan_m": None, "unconfirmed": {}}
    for d in _find_confirm_dirs(runs, confirm_dirs):
        conf = read_confirmation(d, registry)  # raises on a tampered ledger or deviation log
        out["confirm_dirs"].append(str(d))
        out["deviations"] += conf["deviations"]
        for entry in conf["cells"]:
            out["ledger_cells"].append({"cell_id": entry["cell_id"], "plan_hash": entry["plan_hash"],
                                        "code_version": entry.get("code_version"),
                                        "model_revision": entry.get("model_revision"),
                                        "hash": entry["hash"]})
            out["plan_m"] = entry.get("result", {}).get("m", out["plan_m"])
    for run in runs:
        if is_confirm_run(run):
            why = confirmation_status(run, registry)
            if why is not None:
                out["unconfirmed"][run.run_id] = why
                out["warnings"].append(f"UNCONFIRMED {run.path}: {why}")
    return out


def build_report(run_dirs, *, baseline: str | None = None, boot: int = stats.BOOT_DEFAULT,
                 boot_max: int = stats.BOOT_MAX, seed: int = 0, alpha: float = 0.05,
                 m: int | None = None, confirm_dirs=None, grade=None,
                 subset_boot: int = SUBSET_BOOT) -> Report:
    """Load runs, pair them per cell, run the paired tests and the three diagnostics."""
    dirs = find_run_dirs(run_dirs)
    runs = [load_run(d, grade=grade, with_trace=True) for d in dirs]
    if len(runs) < 2:
        raise ProtocolError("a report needs at least two runs (a treatment and a baseline)")
    assign_labels(runs)
    pairs, notes = plan_comparisons(runs, baseline)
    if not pairs:
        raise ProtocolError("no (treatment, baseline) pair shares a cell: nothing to compare")
    prov = provenance(runs, confirm_dirs)
    notes += [w for r in runs for w in r.warnings] + prov["warnings"]
    m = int(m or prov["plan_m"] or len(pairs))
    summaries = {id(r): summarize_run(r) for r in runs}
    rows, subsets, paired = [], [], []
    for t, b in pairs:
        data = pair_runs(t, b)
        paired.append(data)
        res = stats.paired_test(data, alpha=alpha, m=m, boot=boot, boot_max=boot_max, seed=seed)
        st, sb = summaries[id(t)], summaries[id(b)]
        row = {
            "model": t.model, "budget": t.budget, "accounting": t.accounting,
            "treatment": t.label, "baseline": b.label, "treatment_run": t.run_id,
            "baseline_run": b.run_id, "n": res.n, "k": res.k,
            "acc_treatment": res.acc_treatment, "acc_baseline": res.acc_baseline,
            "delta_pp": 100 * res.estimate, "se_pp": 100 * res.se,
            "ci95_lo_pp": 100 * res.ci95[0], "ci95_hi_pp": 100 * res.ci95[1],
            "ci_bonf_lo_pp": 100 * res.ci_bonferroni[0], "ci_bonf_hi_pp": 100 * res.ci_bonferroni[1],
            "ci_bonf_level": res.ci_bonferroni_level, "p_bootstrap": res.p_bootstrap,
            "p_mc_se": res.p_bootstrap_mc_se, "boot": res.boot, "seed": seed, "p_z": res.p_z,
            "p_signflip": res.p_signflip, "p_mcnemar": res.p_mcnemar,
            "p_bonferroni": res.p_bonferroni, "p_holm": float("nan"), "m": m,
            "mde_pp": 100 * res.mde, "verdict": _short_verdict(res),
        }
        for prefix, s in (("t_", st), ("b_", sb)):
            for key in ("cache_mean_tokens", "cache_peak_tokens", "kib_per_token",
                        "cache_mean_kib", "mean_output_tokens", "truncation_rate",
                        "budget_exceeded", "accounting"):
                row[prefix + key] = s[key]
        row["plan_hash"] = t.plan_hash or b.plan_hash
        why = [prov["unconfirmed"][r.run_id] for r in (t, b) if r.run_id in prov["unconfirmed"]]
        row["confirmation"] = ("UNCONFIRMED: " + "; ".join(dict.fromkeys(why)) if why
                               else "confirmed" if is_confirm_run(t) or is_confirm_run(b) else "dev")
        if why:  # a number that is not the pre-registered evidence must not read like one
            row["verdict"] = f"UNCONFIRMED ({row['verdict']})"
        rows.append(row)
        for sub in effect_vs_n(data, seed=seed, boot=min(boot, subset_boot)):
            subsets.append({"model": t.model, "budget": t.budget, "accounting": t.accounting,
                            "treatment": t.label, "baseline": b.label, **sub})
    holm = stats.holm([r["p_bootstrap"] for r in rows], m)
    for row, ph in zip(rows, holm):
        row["p_holm"] = float(ph)
    models = list(dict.fromkeys(r.model for r in runs))
    ordered = sorted(runs, key=lambda r: (models.index(r.model), _budget_key(r.budget), r.label,
                                          r.accounting != "mean", r.accounting))
    arms = [summaries[id(r)] for r in ordered]
    proxy, corr = proxy_agreement(arms)
    traces = {}
    for run in runs:
        if run.trace:
            agg = aggregate_trace(run.trace)
            if agg is not None:
                traces[f"{run.label} ({run.accounting})|{run.model}|{run.budget}"] = {
                    "label": run.label, "accounting": run.accounting, "model": run.model,
                    "budget": run.budget, **agg}
    settings = {"boot": boot, "boot_max": boot_max, "seed": seed, "alpha": alpha, "m": m,
                "subset_boot": min(boot, subset_boot), "baseline": pairs[0][1].label}
    from protocol.report_fidelity import fidelity_comparisons

    return Report(comparisons=rows, arms=arms, accounting=accounting_effects(rows),
                  subsets=subsets, proxy=proxy, proxy_corr=corr, traces=traces,
                  provenance=prov, notes=notes, settings=settings,
                  fidelity=fidelity_comparisons(pairs, boot=min(boot, subset_boot), seed=seed))


def _short_verdict(res: stats.PairedResult) -> str:
    if not res.reject:
        return "n.s."
    return "better" if res.estimate > 0 else "worse"


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


def proxy_agreement(arms: list[dict]) -> tuple[list[dict], list[dict]]:
    """Proxy-drift diagnostic: mean KL / top-1 agreement per arm beside accuracy, and the Spearman
    correlation of each proxy with accuracy across configurations (needs >= 3 arms with fidelity)."""
    from scipy.stats import spearmanr

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
                rho, p = spearmanr(x, y)
                corr.append({"proxy": proxy, "n_configs": len(pts), "spearman_rho": float(rho),
                             "p": float(p)})
            else:
                corr.append({"proxy": proxy, "n_configs": len(pts), "spearman_rho": float("nan"),
                             "p": float("nan")})
    return rows, corr


# --------------------------------------------------------------------------------------------------
# Rendering


def _fmt_num(x, fmt: str) -> str:
    return "-" if x is None or not np.isfinite(x) else format(x, fmt)


def _fmt_budget(b) -> str:
    return "full" if b is None else str(b)


def _fmt_p(p) -> str:
    if p is None or (isinstance(p, float) and np.isnan(p)):
        return "--"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def terminal_summary(rep: Report) -> str:
    """A compact text table of the arms, one of the comparisons, and one line per diagnostic."""
    arm_head = ["arm", "model", "budget", "acct", "acc %", "mean cache", "peak", "KiB mean", "out len",
                "trunc %", "KL mean", "top-1 %", "1st div", "tok/s"]
    arm_body = [[a["label"], a["model"], _fmt_budget(a["budget"]), a["accounting"], f"{100 * a['accuracy']:.1f}",
                 f"{a['cache_mean_tokens']:.1f}", f"{a['cache_peak_tokens']:.0f}", f"{a['cache_mean_kib']:.0f}",
                 f"{a['mean_output_tokens']:.0f}", f"{100 * a['truncation_rate']:.0f}",
                 _fmt_num(a["kl_mean"], ".4f"), _fmt_num(100 * a["top1_agreement"], ".1f"),
                 _fmt_num(a["first_divergence_median"], ".0f"), f"{a['tokens_per_second']:.1f}"]
                for a in rep.arms]
    head = ["model", "budget", "treatment vs baseline", "acct", "acc T", "acc B", "Δ pp",
            "95% CI", "p", "p_bonf", "verdict", "n", "k"]
    body = [[r["model"], _fmt_budget(r["budget"]), f"{r['treatment']} vs {r['baseline']}",
             r["accounting"], f"{100 * r['acc_treatment']:.1f}", f"{100 * r['acc_baseline']:.1f}",
             f"{r['delta_pp']:+.2f}", f"[{r['ci95_lo_pp']:+.1f}, {r['ci95_hi_pp']:+.1f}]",
             _fmt_p(r["p_bootstrap"]), _fmt_p(r["p_bonferroni"]), r["verdict"], str(r["n"]),
             str(r["k"])] for r in rep.comparisons]
    out = [*unconfirmed_banner(rep), _text_table(arm_head, arm_body), "",
           _text_table(head, body),
           f"cluster bootstrap B={rep.settings['boot']} seed={rep.settings['seed']}, "
           f"Bonferroni over m={rep.settings['m']} at alpha={rep.settings['alpha']}"]
    for a in rep.accounting:
        out.append(f"iso-cache {a['model']}/{_fmt_budget(a['budget'])} {a['treatment']} vs "
                   f"{a['baseline']}: Δ {a['delta_prefill_pp']:+.2f} pp under prefill, "
                   f"{a['delta_mean_pp']:+.2f} pp under mean"
                   + ("  <- gain vanishes at equal mean cache" if a["gain_vanishes"] else ""))
    for c in rep.proxy_corr:
        if np.isfinite(c["spearman_rho"]):
            out.append(f"proxy {c['proxy']}: Spearman rho = {c['spearman_rho']:+.2f} with accuracy "
                       f"over {c['n_configs']} configurations (p = {_fmt_p(c['p'])})")
        else:
            out.append(f"proxy {c['proxy']}: correlation with accuracy undefined over {c['n_configs']} "
                       "configurations (accuracy or proxy constant)")
    from protocol.report_fidelity import summary_lines

    out += summary_lines(rep.fidelity)
    prov = rep.provenance
    if prov["plan_hashes"]:
        out.append(f"plan: {', '.join(h[:12] for h in prov['plan_hashes'])}; "
                   f"{len(prov['deviations'])} deviation(s) logged")
    out += [f"note: {n}" for n in rep.notes]
    return "\n".join(out)


def unconfirmed_banner(rep: Report) -> list[str]:
    """Lines shouting that confirm-split numbers lack a valid confirmation (empty when all hold)."""
    bad = rep.provenance.get("unconfirmed") or {}
    if not bad:
        return []
    bar = "!" * 78
    return [bar, f"!!! UNCONFIRMED: {len(bad)} confirm-split run(s) have no valid ledger entry or were "
                 "changed since confirmation.", "!!! Their comparisons are NOT pre-registered evidence:",
            *(f"!!!   {run_id}: {why}" for run_id, why in sorted(bad.items())), bar, ""]


_TEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#",
                "_": r"\_", "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}",
                "^": r"\textasciicircum{}"}


def tex_escape(text) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in str(text))


def _tex_p(p) -> str:
    if p is None or (isinstance(p, float) and np.isnan(p)):
        return "--"
    if p >= 1e-3:
        return f"{p:.2g}"
    mant, exp = f"{p:.1e}".split("e")
    return f"${mant}\\times 10^{{{int(exp)}}}$"


def _tex_num(x, fmt: str) -> str:
    return "--" if x is None or (isinstance(x, float) and np.isnan(x)) else format(x, fmt)


def _tabular(caption: str, label: str, spec: str, header: list[str], rows: list[list[str]]) -> str:
    lines = [r"\begin{table}[t]", r"\centering", r"\small", f"\\caption{{{caption}}}",
             f"\\label{{{label}}}", f"\\begin{{tabular}}{{{spec}}}", r"\toprule",
             " & ".join(header) + r" \\", r"\midrule"]
    lines += [" & ".join(r) + r" \\" for r in rows]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}", ""]
    return "\n".join(lines)


def to_latex(rep: Report) -> str:
    """LaTeX tables (booktabs rules only: \\toprule, \\midrule, \\bottomrule)."""
    s = rep.settings
    main = [[tex_escape(r["model"]), _fmt_budget(r["budget"]), tex_escape(r["treatment"]),
             tex_escape(r["baseline"]), tex_escape(r["accounting"]),
             f"{100 * r['acc_treatment']:.1f}", f"{100 * r['acc_baseline']:.1f}",
             f"{r['delta_pp']:+.1f}", f"[{r['ci95_lo_pp']:+.1f}, {r['ci95_hi_pp']:+.1f}]",
             f"[{r['ci_bonf_lo_pp']:+.1f}, {r['ci_bonf_hi_pp']:+.1f}]", _tex_p(r["p_bootstrap"]),
             _tex_p(r["p_bonferroni"]), r["verdict"], str(r["k"]), str(r["n"])]
            for r in rep.comparisons]
    level = 100 * (1 - s["alpha"] / s["m"])
    out = ["% Generated by `retention report`; needs \\usepackage{booktabs}.",
           _tabular(f"Paired accuracy per cell (cluster bootstrap over problems, $B={s['boot']}$, "
                    f"seed {s['seed']}; Bonferroni over $m={s['m']}$ cells at "
                    f"$\\alpha={s['alpha']}$).", "tab:retention-main", "lllllrrrccrrlrr",
                    ["Model", "Budget", "Treatment", "Baseline", "Acct.", "Acc.~T (\\%)",
                     "Acc.~B (\\%)", "$\\Delta$ (pp)", "95\\% CI",
                     f"{level:.4g}\\% CI", "$p$", "$p_{\\mathrm{Bonf}}$", "Verdict", "$k$", "$n$"],
                    main)]
    arms = [[tex_escape(a["model"]), _fmt_budget(a["budget"]), tex_escape(a["label"]),
             tex_escape(a["accounting"]), f"{100 * a['accuracy']:.1f}",
             _tex_num(a["cache_mean_tokens"], ".0f"), _tex_num(a["cache_peak_tokens"], ".0f"),
             _tex_num(a["kib_per_token"], ".1f"), _tex_num(a["mean_output_tokens"], ".0f"),
             _tex_num(100 * a["truncation_rate"], ".1f"), str(a["budget_exceeded"])]
            for a in rep.arms]
    out.append(_tabular("Measured cache and generation per arm.", "tab:retention-arms",
                        "llllrrrrrrr",
                        ["Model", "Budget", "Arm", "Acct.", "Acc. (\\%)", "Mean cache",
                         "Peak cache", "KiB/token", "Mean len.", "Trunc. (\\%)", "Exceeded"], arms))
    if rep.accounting:
        acc = [[tex_escape(a["model"]), _fmt_budget(a["budget"]), tex_escape(a["treatment"]),
                tex_escape(a["baseline"]), f"{a['delta_prefill_pp']:+.1f}", _tex_p(a["p_prefill"]),
                f"{a['delta_mean_pp']:+.1f}", _tex_p(a["p_mean"])] for a in rep.accounting]
        out.append(_tabular("Iso-cache check: the same comparison under \\texttt{prefill} and "
                            "\\texttt{mean} budget accounting.", "tab:retention-isocache",
                            "llllrrrr", ["Model", "Budget", "Treatment", "Baseline",
                                         "$\\Delta$ prefill", "$p$", "$\\Delta$ mean", "$p$"], acc))
    if rep.subsets:
        sizes = sorted({r["n"] for r in rep.subsets})
        table: dict = {}
        for r in rep.subsets:
            key = (r["model"], r["budget"], r["treatment"], r["baseline"], r["accounting"])
            table.setdefault(key, {})[r["n"]] = r["estimate"]
        body = [[tex_escape(k[0]), _fmt_budget(k[1]), tex_escape(f"{k[2]} vs {k[3]} ({k[4]})"),
                 *[_tex_num(None if n not in v else 100 * v[n], "+.1f") for n in sizes]]
                for k, v in table.items()]
        out.append(_tabular("Effect (pp) on nested random subsets of problems.",
                            "tab:retention-subsets", "lll" + "r" * len(sizes),
                            ["Model", "Budget", "Comparison", *[f"$n={n}$" for n in sizes]], body))
    if rep.proxy:
        body = [[tex_escape(p["model"]), _fmt_budget(p["budget"]), tex_escape(p["label"]),
                 tex_escape(p["accounting"]), f"{100 * p['accuracy']:.1f}", _tex_num(p["kl_mean"], ".3g"),
                 _tex_num(p["top1_agreement"], ".3f")] for p in rep.proxy]
        cap = "Proxy metrics against the full cache beside accuracy."
        for c in rep.proxy_corr:
            cap += (f" Spearman $\\rho$ ({tex_escape(c['proxy'])}, accuracy) $= "
                    f"{_tex_num(c['spearman_rho'], '+.2f')}$ over {c['n_configs']} configurations.")
        out.append(_tabular(cap, "tab:retention-proxy", "llllrrr",
                            ["Model", "Budget", "Arm", "Acct.", "Acc. (\\%)", "KL", "Top-1 agr."],
                            body))
    prov = rep.provenance
    if prov.get("unconfirmed"):
        out.append("\\begin{center}\\fbox{\\Large\\textbf{UNCONFIRMED: "
                   f"{len(prov['unconfirmed'])} confirm-split run(s) without a valid ledger entry; "
                   "not pre-registered evidence}}\\end{center}")
    if prov["plan_hashes"] or prov["deviations"]:
        out.append("\\paragraph{Pre-registration.} Plan "
                   + ", ".join(f"\\texttt{{{h[:12]}}}" for h in prov["plan_hashes"]) + ". "
                   + (f"{len(prov['deviations'])} deviation(s) from the plan:" if prov["deviations"]
                      else "No deviations from the plan."))
        if prov["deviations"]:
            out.append("\\begin{itemize}")
            for d in prov["deviations"]:
                detail = {k: v for k, v in d.items() if k not in ("prev", "hash", "plan_hash", "at")}
                out.append(f"\\item {tex_escape(json.dumps(detail, sort_keys=True))}")
            out.append("\\end{itemize}")
        out.append("")
    return "\n".join(out)


def write_report(rep: Report, out_dir) -> list[Path]:
    """Write CSVs, LaTeX, JSON and figures into out_dir (each file replaced atomically).

    `report-files.json` lists what was written; files of an earlier report into the same folder
    that this one does not write (a figure of a cell no longer present) are removed, so the folder
    never mixes two reports. Files the report did not write are never touched.
    """
    import pandas as pd

    from protocol.io import dumps, ensure_dir, write_atomic
    from protocol import report_figures

    out_dir = ensure_dir(Path(out_dir), "report folder")
    listing = out_dir / REPORT_LISTING
    previous = []
    if listing.exists():
        try:
            previous = [str(n) for n in load_json_object(listing, "report listing").get("files", [])]
        except ProtocolError:
            previous = []
    written = []

    def put(name: str, data: str | bytes) -> None:
        write_atomic(out_dir / name, data)
        written.append(out_dir / name)

    put("report.csv", pd.DataFrame(rep.comparisons).to_csv(index=False))
    put("arms.csv", pd.DataFrame(rep.arms).to_csv(index=False))
    put("effect_vs_n.csv", pd.DataFrame(rep.subsets).to_csv(index=False))
    if rep.accounting:
        put("diag_accounting.csv", pd.DataFrame(rep.accounting).to_csv(index=False))
    if rep.proxy:
        put("diag_proxy.csv", pd.DataFrame(rep.proxy).to_csv(index=False))
    if rep.fidelity:
        put("fidelity_exploratory.csv", pd.DataFrame(rep.fidelity).to_csv(index=False))
    put("report.tex", to_latex(rep))
    put("report.json", dumps(json_safe(rep.to_dict()), indent=1) + "\n")
    for name, png in report_figures.render_all(rep).items():
        put(name, png)
    names = {p.name for p in written}
    for stale in sorted(set(previous) - names):
        path = out_dir / Path(stale).name  # names only: never a path outside out_dir
        if path.is_file():
            path.unlink()
    write_atomic(listing, dumps({"files": sorted(names)}, indent=1) + "\n")
    return written


REPORT_LISTING = "report-files.json"


def json_safe(obj):
    """Plain JSON: numpy scalars to Python, NaN/inf to null, paths to strings."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if np.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    return obj
