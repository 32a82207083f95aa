"""Reports over run directories (protocol section 6): the entry point.

`build_report` loads run directories (`protocol.runs`), refuses a run reached twice, pairs the runs
of each cell with the baseline arm (`protocol.comparisons`), applies the registered test to
confirmed cells (`protocol.provenance`), runs the diagnostics (`protocol.diagnostics`) and the
failure-mode counts (`protocol.failure_modes`) and returns a `Report`; `write_report` and `terminal_summary` render it (`protocol.render`).

The names other modules use stay importable from here (`load_run`, `pair_runs`, `find_run_dirs`,
`json_safe`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.comparisons import (BASELINE_SCORER, SUBSET_BOOT, budget_key, compare,  # noqa: F401
                                  match_baseline, mixed_family, pair_tests, plan_comparisons, slot_notes)
from protocol.design_space import design_space_rows
from protocol.diagnostics import (accounting_effects, aggregate_trace, effect_vs_n,  # noqa: F401
                                  proxy_agreement, sceptic_diagnostics, subset_sizes, summarize_run)
from protocol.errors import ProtocolError
from protocol.failure_modes import failure_modes
from protocol.provenance import confirmation_status, is_confirm_run, provenance  # noqa: F401
from protocol.render import (REPORT_LISTING, json_safe, tex_escape, terminal_summary,  # noqa: F401
                             to_latex, unconfirmed_banner, write_report)
from protocol.report_fidelity import fidelity_comparisons
from protocol.run_types import check_run
from protocol.runs import (Run, assign_labels, correct, find_run_dirs, load_run, pair_runs,  # noqa: F401
                           refuse_duplicates, sizing_notes)
from protocol.splits import problems_by_id
from protocol.verdicts import check_verdicts


@dataclass
class Report:
    comparisons: list   # dict per (treatment, baseline) pair: the main table
    arms: list          # dict per run
    accounting: list    # iso-cache diagnostic rows
    subsets: list       # effect vs n rows
    proxy: list         # per-arm proxy rows
    proxy_corr: list    # Spearman rows
    traces: dict        # run label -> aggregated trace
    provenance: dict    # plan hashes, ledger, registered tests, attempts, deviations
    notes: list
    settings: dict
    fidelity: list = field(default_factory=list)  # exploratory paired test on the fidelity proxy
    design_space: list = field(default_factory=list)  # the comparisons grouped by family (protocol.design_space)
    failure_modes: list = field(default_factory=list)  # per run: compacted at all, prompt evicted (protocol.failure_modes)
    sceptic: list = field(default_factory=list)  # per run: acc_strict, truncation, looping, guessing (diagnostics)
    runs: list = field(default_factory=list, repr=False)  # the loaded runs (the viewer reads them; not written)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "comparisons": self.comparisons, "arms": self.arms,
                "fidelity_exploratory": self.fidelity, "design_space": self.design_space,
                "failure_modes": self.failure_modes,
                "diagnostics": {"accounting": self.accounting, "subsets": self.subsets, "sceptic": self.sceptic,
                                "proxy": self.proxy, "proxy_correlation": self.proxy_corr},
                "provenance": self.provenance, "notes": self.notes}


def _problem_texts() -> dict[str, str]:
    """problem_id -> text of the shipped MATH-500 copy (other datasets' problems: none)."""
    return {pid: p.problem for pid, p in problems_by_id(None).items()}


def build_report(run_dirs, *, baseline: str | None = None, boot: int | None = None,
                 boot_max: int | None = None, seed: int | None = None, alpha: float | None = None,
                 m: int | None = None, confirm_dirs=None, grade=None,
                 subset_boot: int = SUBSET_BOOT, registry=None) -> Report:
    """Load runs, pair them per cell, run the paired tests and the three diagnostics.

    boot, boot_max, seed, alpha, m: the test of comparisons that are not confirmed cells (None:
    the defaults; m: the number of such comparisons). A confirmed cell is tested as registered;
    a given value that differs from its registered one is refused. registry: the registry of
    plans and confirmations (default: the user's, `protocol.ledger.Registry()`)."""
    runs = [load_run(d, grade=grade, with_trace=True) for d in find_run_dirs(run_dirs)]
    # stored verdicts are what the tables count: each is checked against a re-grade of its text
    # (a caller's own `grade` is a stand-in grader: there is nothing to check against)
    checked = check_verdicts(runs, _problem_texts()) if grade is None and len(runs) >= 2 else []
    rep = report_from_runs(runs, baseline=baseline, boot=boot, boot_max=boot_max, seed=seed, alpha=alpha, m=m,
                           confirm_dirs=confirm_dirs, subset_boot=subset_boot, registry=registry)
    rep.notes += checked + sizing_notes(run_dirs)
    return rep


def report_from_runs(runs: list[Run], *, baseline: str | None = None, boot: int | None = None,
                     boot_max: int | None = None, seed: int | None = None, alpha: float | None = None,
                     m: int | None = None, confirm_dirs=None, subset_boot: int = SUBSET_BOOT,
                     registry=None) -> Report:
    """`build_report` over runs already loaded (`load_run(..., with_trace=True)`)."""
    if len(runs) < 2:
        raise ProtocolError("a report needs at least two runs (a treatment and a baseline)")
    for run in runs:  # a string where a number belongs: one line naming the file and record
        check_run(run)
    refuse_duplicates(runs)
    assign_labels(runs)
    pairs, notes = plan_comparisons(runs, baseline)
    if not pairs:
        raise ProtocolError("no (treatment, baseline) pair shares a cell: nothing to compare"
                            + (f" ({notes[0]})" if notes else ""))
    prov = provenance(runs, confirm_dirs, registry)
    notes += [w for r in runs for w in r.warnings] + prov["warnings"]
    given = {"boot": boot, "boot_max": boot_max, "seed": seed, "alpha": alpha, "m": m}
    tests = pair_tests(pairs, prov, given)
    notes += [n for n in [mixed_family(pairs, tests)] if n] + slot_notes(pairs)
    summaries = {id(r): summarize_run(r) for r in runs}
    rows, subsets = compare(pairs, tests, summaries, prov, subset_boot)
    models = list(dict.fromkeys(r.model for r in runs))
    ordered = sorted(runs, key=lambda r: (models.index(r.model), budget_key(r.budget), str(r.split),
                                          r.label, r.accounting != "mean", r.accounting))
    arms = [summaries[id(r)] for r in ordered]
    proxy, corr = proxy_agreement(arms)
    failures, failure_notes = failure_modes(ordered)
    notes += failure_notes
    traces = {}
    for run in runs:
        if run.trace:
            agg = aggregate_trace(run.trace)
            if agg is not None:
                traces[f"{run.label} ({run.accounting})|{run.model}|{run.budget}|{run.split}"] = {
                    "label": run.label, "accounting": run.accounting, "model": run.model,
                    "budget": run.budget, **agg}
    first = tests[0]
    settings = {"boot": first["boot"], "boot_max": first["boot_max"], "seed": first["seed"],
                "alpha": first["alpha"], "m": first["m"], "source": first["source"],
                "subset_boot": min(first["boot"], subset_boot), "baseline": pairs[0][1].label,
                "given": {k: v for k, v in given.items() if v is not None}}
    return Report(comparisons=rows, arms=arms, accounting=accounting_effects(rows),
                  subsets=subsets, proxy=proxy, proxy_corr=corr, traces=traces,
                  provenance=prov, notes=notes, settings=settings,
                  fidelity=fidelity_comparisons(pairs, boot=settings["subset_boot"], seed=first["seed"]),
                  design_space=design_space_rows(rows, runs, arms), failure_modes=failures,
                  sceptic=[sceptic_diagnostics(r) for r in ordered], runs=runs)
