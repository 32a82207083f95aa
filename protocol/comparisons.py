"""Which runs a report compares, and the paired test of each comparison (protocol section 6).

* cell = (model, budget, split, dataset) of a run's configuration (`Run.cell`);
* arm = scorer plus declared parameters (`Run.arm_signature`; statistics are identified by content
  and not part of the arm, so each model's own statistics make one arm across models);
* baseline = the run named by `baseline` (run id, directory, label or scorer name), else the run
  whose scorer is `triattention`, else the first run given. Its arm is the baseline arm of every
  cell: in each cell the run with the very same statistics when present, else the run of that arm
  (the cell's own statistics). When a cell holds baseline runs of several accounting modes, a
  treatment is compared with the one of its own mode. Every other run of the cell is a treatment.

The test of a comparison is the one registered for its cell when it is confirmed
(`protocol.provenance`), else the command-line settings (or their defaults).
"""

from __future__ import annotations

import re
from pathlib import Path

from protocol import stats
from protocol.design_space import MECHANISM_KEYS
from protocol.diagnostics import effect_vs_n
from protocol.errors import ProtocolError
from protocol.exploration import explored_ids
from protocol.provenance import check_given, cell_status, is_confirm_run, ledger_cell_of
from protocol.runs import Run, pair_runs, prompt_convention

BASELINE_SCORER = "triattention"
SUBSET_BOOT = 20_000  # resamples per nested-subset test: a diagnostic, not a decision
DEFAULTS = {"boot": stats.BOOT_DEFAULT, "boot_max": stats.BOOT_MAX, "seed": 0, "alpha": 0.05}


def budget_key(b):
    return (b is None, b if b is not None else 0)


def _plainest(runs: list[Run]) -> list[Run]:
    """Runs of one scorer, those changing the fewest other families first (stable; a configuration
    names a family only when it is not at its default): a bare scorer
    name means the scorer with every other family at its default, not a variant that happens to
    come first (with PyramidKV beside it, plain TriAttention's label carries its routing parameter)."""
    return sorted(runs, key=lambda run: sum(f in run.config for f in MECHANISM_KEYS))


def match_baseline(runs: list[Run], baseline: str | None) -> Run:
    if baseline is None:
        plain = [run for run in runs if getattr(run, "label", None) == BASELINE_SCORER]
        named = plain or _plainest([run for run in runs if run.scorer == BASELINE_SCORER])
        return named[0] if named else runs[0]
    target = Path(baseline)
    for run in runs:
        same_dir = target.exists() and run.path.resolve() == target.resolve()
        if baseline in (run.run_id, run.path.name) or same_dir:
            return run
    # A label (e.g. `triattention+pp`) names one variant; a bare scorer name prefers the run whose
    # label is just that name (the default rule and parameters) over its variants.
    named = [run for run in runs if getattr(run, "label", None) == baseline]
    named = named or _plainest([run for run in runs if run.scorer == baseline])
    if named:
        return named[0]
    raise ProtocolError(f"--baseline {baseline!r} matches no run id, run directory, label or scorer")


def _cell_name(cell) -> str:
    return f"cell {cell[0]} / budget {'full' if cell[1] is None else cell[1]} / split {cell[2]}"


def _plan_pairs(runs: list[Run], ref: Run, named: bool) -> list[tuple[Run, Run]]:
    """The (treatment, baseline) pairs a plan registered, from the runs' confirm.json sidecars:
    per confirmation of a plan's cell, its treatment run with its baseline run. With a named baseline, only the
    plans whose baseline is of that arm (a swapped comparison is formed, and reported, as such)."""
    arms: dict = {}
    for run in runs:
        side = run.confirm or {}
        if side.get("plan_hash") and side.get("plan_hash") == run.plan_hash and side.get("arm") in ("treatment", "baseline"):
            # one confirmation of the cell: a plan confirmed in two registries has two
            key = (side["plan_hash"], side.get("cell_id"), side.get("ledger_entry"))
            arms.setdefault(key, {}).setdefault(side["arm"], []).append(run)
    pairs = []
    for found in arms.values():
        (t, *more_t), (b, *more_b) = found.get("treatment") or [None], found.get("baseline") or [None]
        if t is None or b is None or more_t or more_b:
            continue  # left to the ordinary rule (within the plan)
        if not named or b.arm_signature == ref.arm_signature:
            pairs.append((t, b))
    return pairs


def _plan_name(h) -> str:
    return f"plan {h[:12]}" if h else "runs of no plan"


def plan_comparisons(runs: list[Run], baseline: str | None = None) -> tuple[list, list]:
    """Pairs (treatment, baseline) per cell, and notes about cells without a baseline run.

    Within a cell, the pairs each plan registered come first (`_plan_pairs`); the other runs pair
    with a baseline run of their own plan (or, for runs of no plan, of no plan): a cross-plan pair
    is never formed, and a run left without one is noted. A run without a budget (`full`, no
    eviction) is a reference for every budget of its model and split: it joins each of those
    cells as a possible baseline and is never a treatment there.
    """
    ref = match_baseline(runs, baseline)
    budgeted = {(r.model, r.split) for r in runs if r.budget is not None}
    unbudgeted = [r for r in runs if r.budget is None and (r.model, r.split) in budgeted]
    cells: dict = {}
    for run in runs:
        if run not in unbudgeted:
            cells.setdefault(run.cell, []).append(run)
    pairs, notes = [], []
    models = list(dict.fromkeys(r.model for r in runs))
    for key in sorted(cells, key=lambda c: (models.index(c[0]), budget_key(c[1]), str(c[2]))):
        planned = _plan_pairs(cells[key], ref, baseline is not None)
        taken = {id(r) for pair in planned for r in pair}
        members = [r for r in cells[key] + [r for r in unbudgeted if (r.model, r.split) == (key[0], key[2])]
                   if id(r) not in taken]
        cell_pairs = list(planned)
        by_plan: dict = {}
        for run in members:
            by_plan.setdefault(run.plan_hash, []).append(run)
        for h, group in by_plan.items():
            found, note = _pairs_of_group(key, group, ref, runs)
            cell_pairs += found
            if note and (planned or any(_bases(g, ref) for g in by_plan.values())):
                note = (f"{_cell_name(key)}: {_plan_name(h)} has no {ref.label} baseline run of its own "
                        "here; not compared (a cross-plan pair is never formed)")
            if note:
                notes.append(note)
        cell_pairs.sort(key=lambda p: (p[0].label, p[0].accounting != "mean", p[0].accounting,
                                       str(p[0].plan_hash or "")))
        pairs += cell_pairs
    return pairs, notes


def _bases(members: list[Run], ref: Run) -> list[Run]:
    return ([r for r in members if r.signature == ref.signature]
            or [r for r in members if r.arm_signature == ref.arm_signature])


def _pairs_of_group(key, members: list[Run], ref: Run, runs: list[Run]) -> tuple[list, str | None]:
    """Pairs within one plan's runs of a cell (or runs of no plan): each treatment with the
    baseline run of its accounting mode (else the `mean` one). Returns (pairs, note or None)."""
    bases = _bases(members, ref)
    if not bases:
        elsewhere = sorted({str(r.split) for r in runs if (r.model, r.budget) == key[:2]
                            and r.split != key[2] and r.arm_signature == ref.arm_signature})
        why = (f"the {ref.label} baseline ran on split {', '.join(elsewhere)}: different splits"
               if elsewhere else f"no {ref.label} baseline run")
        return [], f"{_cell_name(key)}: {why}; not compared"
    for acct in {b.accounting for b in bases}:
        same = {b.signature for b in bases if b.accounting == acct}
        if len(same) > 1:
            raise ProtocolError(f"{_cell_name(key)}: several {ref.label} runs with different calibration "
                                f"statistics ({acct} accounting); name the baseline run with --baseline")
    bases.sort(key=lambda r: r.accounting != "mean")  # a `mean` run is the default partner
    pairs = []
    for run in members:
        if run in bases or (run.budget is None and key[1] is not None):
            continue
        pairs.append((run, next((b for b in bases if b.accounting == run.accounting), bases[0])))
    return pairs, None


def _short_verdict(res: stats.PairedResult) -> str:
    if not res.reject:
        return "n.s."
    return "better" if res.estimate > 0 else "worse"


def pair_tests(pairs: list, prov: dict, given: dict) -> list[dict]:
    """The test of each pair: the registered one for a confirmed cell (a differing command-line
    value is refused), else the command-line values, else the defaults. m defaults to the number
    of comparisons that are not registered *on the same dataset*: each dataset is its own
    Bonferroni family (named in the source when a report mixes datasets); a given m makes one
    family of them all (`mixed_family` states it)."""
    cells = [ledger_cell_of(prov, t, b) for t, b in pairs]
    free = [t.dataset for (t, _b), c in zip(pairs, cells) if c is None or c.get("test") is None]
    per_dataset = {d: free.count(d) for d in free}
    out = []
    for (t, _b), cell in zip(pairs, cells):
        test = cell.get("test") if cell else None
        if test is not None:
            check_given(given, test, cell)
            out.append({"source": f"registered (plan {cell['plan_hash'][:12]})", "cell": cell,
                        **{k: test[k] if test.get(k) is not None else
                           (given.get(k) if given.get(k) is not None else DEFAULTS.get(k, len(free)))
                           for k in ("boot", "boot_max", "seed", "alpha", "m")}})
        else:
            boot = given["boot"] if given.get("boot") is not None else DEFAULTS["boot"]
            if given.get("boot_max") is not None and given["boot_max"] < boot:
                raise ProtocolError(f"--boot-max {given['boot_max']} is below --boot {boot}: the escalated "
                                    "resamples cannot be fewer than the first ones")
            split = len(per_dataset) > 1 and given.get("m") is None
            out.append({"source": f"report settings ({t.dataset})" if split else "report settings", "cell": cell,
                        **{k: given[k] if given.get(k) is not None else DEFAULTS[k] for k in DEFAULTS},
                        "m": int(given.get("m") or per_dataset[t.dataset])})
    return out


def slot_notes(pairs: list) -> list[str]:
    """One line per comparison whose paired records were decoded at different slot counts (the
    records' `slots`): a record of this project's engine depends on its slot count (in bfloat16 the
    kernels round differently for each), so part of such a paired difference is rounding."""
    notes = []
    for t, b in pairs:
        slots_b = {(r["problem_id"], r["sample"]): r.get("slots") for r in b.records}
        differ = [(r.get("slots"), slots_b[k]) for r in t.records
                  if (k := (r["problem_id"], r["sample"])) in slots_b and None not in (r.get("slots"), slots_b[k])
                  and r.get("slots") != slots_b[k]]
        if differ:
            counts = ", ".join(f"{x} vs {y}" for x, y in sorted(set(differ)))
            notes.append(f"WARNING {t.model}/{t.budget} {t.label} vs {b.label}: {len(differ)} paired record(s) "
                         f"decoded at different slot counts ({counts}); rerun one arm at the other's --batch-size "
                         "to compare them at one")
    return notes


def mixed_family(pairs: list, tests: list[dict]) -> str | None:
    """A note when one Bonferroni family (a given --m) spans several datasets, else None."""
    datasets = sorted({t.dataset for (t, _b), test in zip(pairs, tests) if test["source"] == "report settings"})
    if len(datasets) < 2:
        return None
    m = next(test["m"] for test in tests if test["source"] == "report settings")
    return f"one Bonferroni family (m={m}, --m) spans the datasets {', '.join(datasets)}"


def compare(pairs: list, tests: list[dict], summaries: dict, prov: dict, subset_boot: int) -> tuple[list, list]:
    """Rows of the main table (one per pair) and the nested-subset rows."""
    rows, subsets = [], []
    for (t, b), test in zip(pairs, tests):
        data = pair_runs(t, b)
        res = stats.paired_test(data, alpha=test["alpha"], m=test["m"], boot=test["boot"],
                                boot_max=test["boot_max"], seed=test["seed"])
        row = {
            "model": t.model, "dataset": t.dataset, "budget": t.budget, "split": t.split,
            "accounting": t.accounting,
            "treatment": t.label, "baseline": b.label, "treatment_run": t.run_id,
            "baseline_run": b.run_id, "n": res.n, "k": res.k,
            "acc_treatment": res.acc_treatment, "acc_baseline": res.acc_baseline,
            "delta_pp": 100 * res.estimate, "se_pp": 100 * res.se,
            "ci95_lo_pp": 100 * res.ci95[0], "ci95_hi_pp": 100 * res.ci95[1],
            "ci_bonf_lo_pp": 100 * res.ci_bonferroni[0], "ci_bonf_hi_pp": 100 * res.ci_bonferroni[1],
            "ci_bonf_level": res.ci_bonferroni_level, "p_bootstrap": res.p_bootstrap,
            "p_mc_se": res.p_bootstrap_mc_se, "boot": res.boot, "boot_requested": test["boot"],
            "boot_max": test["boot_max"], "seed": test["seed"], "alpha": test["alpha"], "p_z": res.p_z,
            "p_signflip": res.p_signflip, "p_mcnemar": res.p_mcnemar,
            "p_bonferroni": res.p_bonferroni, "p_holm": float("nan"), "m": test["m"],
            "test_source": test["source"], "mde_pp": 100 * res.mde, "verdict": _short_verdict(res),
            "t_prompt": t.prompt_rule, "b_prompt": b.prompt_rule,
            "prompt_convention": prompt_convention(t.prompt_rule, b.prompt_rule),
        }
        for prefix, s in (("t_", summaries[id(t)]), ("b_", summaries[id(b)])):
            for key in ("cache_mean_tokens", "cache_peak_tokens", "kib_per_token",
                        "cache_mean_kib", "mean_output_tokens", "truncation_rate",
                        "budget_exceeded", "accounting"):
                row[prefix + key] = s[key]
        row["plan_hash"] = t.plan_hash or b.plan_hash
        row.update(code_provenance(t, b))
        row["confirmation"], deviates = _confirmation(t, b, test["cell"], prov)
        seen = _seen_in_exploration(t, b)
        if seen and row["confirmation"] != "dev":  # a confirm set that was looked at before
            row["confirmation"] += f"; confirm set seen during exploration ({seen} of {res.n} problems)"
        if row["confirmation"].startswith("UNCONFIRMED"):
            row["verdict"] = f"UNCONFIRMED ({row['verdict']})"  # not the pre-registered evidence
        elif deviates:
            row["verdict"] = f"DEVIATION ({row['verdict']})"
        rows.append(row)
        for sub in effect_vs_n(data, seed=test["seed"], boot=min(test["boot"], subset_boot)):
            subsets.append({"model": t.model, "dataset": t.dataset, "budget": t.budget, "accounting": t.accounting,
                            "treatment": t.label, "baseline": b.label, **sub})
    families: dict = {}  # Holm within each family (one registered test, or the command line's)
    for i, row in enumerate(rows):
        families.setdefault((row["test_source"], row["m"]), []).append(i)
    for (_source, m), idx in families.items():
        for i, ph in zip(idx, stats.holm([rows[i]["p_bootstrap"] for i in idx], m)):
            rows[i]["p_holm"] = float(ph)
    return rows, subsets


def _dirty(version) -> bool:
    """A code version of a tree with uncommitted changes (`git describe --dirty`: `-dirty`;
    `retention`'s own: `.dirty`)."""
    return bool(re.search(r"[-.]dirty\b", str(version or "")))


def code_provenance(t: Run, b: Run) -> dict:
    """Code version and model quantisation of both arms, and what is wrong with them: arms run on
    different code, from a tree with uncommitted changes, or of differently quantised models
    (`code_flag`, "" when nothing is)."""
    tv, bv = t.meta.get("code_version"), b.meta.get("code_version")
    tq, bq = t.config.get("model_quant"), b.config.get("model_quant")
    flags = (["different code"] if tv != bv else []) + (["uncommitted changes"] if _dirty(tv) or _dirty(bv) else []) \
        + ([f"quantisation {tq or 'none'} vs {bq or 'none'}"] if tq != bq else [])
    return {"t_code_version": tv, "b_code_version": bv, "t_model_quant": tq, "b_model_quant": bq,
            "code_flag": "; ".join(flags)}


def _seen_in_exploration(t: Run, b: Run) -> int:
    """How many problems of a confirmation's set an exploration run (`retention run --dataset`) saw
    first. MATH-500's confirm split is never reachable by `run`; an AIME set is its own confirm set,
    so exploring it and confirming on it later is possible, and flagged."""
    if not (is_confirm_run(t) or is_confirm_run(b)) or t.dataset == "math500":
        return 0
    return len(explored_ids(t.dataset) & {r["problem_id"] for r in t.records})


def _confirmation(t: Run, b: Run, cell: dict | None, prov: dict) -> tuple[str, bool]:
    why = [prov["unconfirmed"][r.run_id] for r in (t, b) if r.run_id in prov["unconfirmed"]]
    if why:
        return "UNCONFIRMED: " + "; ".join(dict.fromkeys(why)), False
    if cell is not None:
        return cell_status(prov, cell)
    if is_confirm_run(t) or is_confirm_run(b):  # e.g. the arms swapped by --baseline
        return "UNCONFIRMED: not a registered comparison of a confirmed cell", False
    return "dev", False
