"""Rendering a report: the terminal summary, LaTeX tables (booktabs) and the files of `--out`.

`write_report` writes report.csv (one row per comparison), arms.csv, effect_vs_n.csv, the
diagnostics CSVs, report.tex, report.json, the PNG figures (`protocol.report_figures`) and
`report-files.json` (the listing), and returns every path it wrote, the listing included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from protocol import report_figures
from protocol.design_space import design_space_lines
from protocol.diagnostics import sceptic_lines
from protocol.errors import ProtocolError
from protocol.io import dumps, ensure_dir, load_json_object, write_atomic
from protocol.report_fidelity import floor_lines, summary_lines

REPORT_LISTING = "report-files.json"
INCOMPLETE = "REPORT-INCOMPLETE"  # present only while (or if killed while) a report is written


def _fmt_num(x, fmt: str) -> str:
    return "-" if x is None or not np.isfinite(x) else format(x, fmt)


def _fmt_budget(b) -> str:
    return "full" if b is None else str(b)


def budget_label(arm: dict) -> str:
    """An arm's budget as it was given: KiB for a `--budget-bytes` arm (never the token figure it
    was matched by), tokens otherwise."""
    kib = arm.get("budget_kib")
    return f"{float(kib):g} KiB" if kib is not None else _fmt_budget(arm.get("budget"))


def matched_unit(arms: list[dict]) -> str:
    """What a pairing of arms matched: KiB when an arm was given in KiB, else tokens ("full": no budget)."""
    if any(a.get("budget_kib") is not None for a in arms):
        return "KiB"
    return "full" if all(a.get("budget") is None for a in arms) else "tokens"


def _measured(row: dict, prefix: str) -> str:
    """An arm's measured mean cache: tokens per (layer, KV head) and KiB per sequence."""
    tok, kib = row.get(f"{prefix}cache_mean_tokens"), row.get(f"{prefix}cache_mean_kib")
    return f"{_fmt_num(tok, '.1f')} tok / {_fmt_num(kib, '.1f')} KiB"


def _pair_arms(rep, row: dict) -> list[dict]:
    by_run = {a.get("run_id"): a for a in rep.arms}
    return [by_run.get(row.get("treatment_run"), {}), by_run.get(row.get("baseline_run"), {})]


def _pair_budget(rep, row: dict) -> str:
    arms = _pair_arms(rep, row)
    labels = list(dict.fromkeys(budget_label(a) for a in arms if a))
    return " vs ".join(labels) if labels else _fmt_budget(row.get("budget"))


def _fmt_p(p) -> str:
    if p is None or (isinstance(p, float) and np.isnan(p)):
        return "--"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _data(row: dict) -> str:
    """Dataset and split of a row (`math500/dev`, `aime24/confirm`): part of every row's label."""
    return f"{row.get('dataset') or 'math500'}/{row.get('split')}"


def _model(model, quant) -> str:
    """A model with its quantisation when the run recorded one (`model_quant`, e.g. Q4_K_M)."""
    return f"{model} ({quant})" if quant else str(model)


def _text_table(headers: list[str], rows: list[list[str]], left: int = 2) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= left else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def terminal_summary(rep) -> str:
    """A compact text table of the arms, one of the comparisons, and one line per diagnostic."""
    arm_head = ["arm", "model", "data", "budget", "acct", "prompt", "acc %", "mean cache", "peak", "KiB mean",
                "out len", "trunc %", "KL mean", "top-1 %", "1st div", "tok/s"]
    arm_body = [[a["label"], _model(a["model"], a.get("model_quant")), _data(a), budget_label(a), a["accounting"],
                 a.get("prompt", "evict"), f"{100 * a['accuracy']:.1f}",
                 f"{a['cache_mean_tokens']:.1f}", f"{a['cache_peak_tokens']:.0f}", f"{a['cache_mean_kib']:.0f}",
                 f"{a['mean_output_tokens']:.0f}", f"{100 * a['truncation_rate']:.0f}",
                 _fmt_num(a["kl_mean"], ".4f"), _fmt_num(100 * a["top1_agreement"], ".1f"),
                 _fmt_num(a["first_divergence_median"], ".0f"), f"{a['tokens_per_second']:.1f}"]
                for a in rep.arms]
    head = ["model", "data", "budget", "treatment vs baseline", "acct", "prompt", "acc T", "acc B", "Δ pp",
            "95% CI", "p", "p_bonf", "verdict", "n", "k", "matched", "cache T", "cache B"]
    body = [[_model(r["model"], r.get("t_model_quant")), _data(r), _pair_budget(rep, r),
             f"{r['treatment']} vs {r['baseline']}",
             r["accounting"], _convention(r), f"{100 * r['acc_treatment']:.1f}", f"{100 * r['acc_baseline']:.1f}",
             f"{r['delta_pp']:+.2f}", f"[{r['ci95_lo_pp']:+.1f}, {r['ci95_hi_pp']:+.1f}]",
             _fmt_p(r["p_bootstrap"]), _fmt_p(r["p_bonferroni"]), r["verdict"], str(r["n"]),
             str(r["k"]), matched_unit(_pair_arms(rep, r)), _measured(r, "t_"), _measured(r, "b_")]
            for r in rep.comparisons]
    out = [*unconfirmed_banner(rep), _text_table(arm_head, arm_body, left=3), "",
           _text_table(head, body, left=3), *test_lines(rep)]
    for r in rep.comparisons:
        if str(r.get("prompt_convention", "")).startswith("MIXED"):
            out.append(f"prompt {_where(r)} {r['treatment']} vs {r['baseline']}: {r['prompt_convention']}")
    for r in rep.comparisons:
        if r["confirmation"] not in ("dev", "confirmed"):
            out.append(f"status {_where(r)} {r['treatment']} vs {r['baseline']}: {r['confirmation']}")
    out += code_lines(rep)
    for a in rep.accounting:
        out.append(f"iso-cache {a['model']}/{_fmt_budget(a['budget'])} {a['treatment']} vs "
                   f"{a['baseline']}: Δ {a['delta_prefill_pp']:+.2f} pp under prefill, "
                   f"{a['delta_mean_pp']:+.2f} pp under mean"
                   + ("  <- gain vanishes at equal mean cache" if a["gain_vanishes"] else ""))
    for c in rep.proxy_corr:
        if np.isfinite(c["spearman_rho"]):
            out.append(f"proxy {c['proxy']}: Spearman rho = {c['spearman_rho']:+.2f} with accuracy "
                       f"over {c['n_configs']} configurations (p = {_fmt_p(c['p'])}, {c.get('p_method', 'exact')})")
        else:
            out.append(f"proxy {c['proxy']}: correlation with accuracy undefined over {c['n_configs']} "
                       "configurations (accuracy or proxy constant)")
    out += floor_lines(rep.arms) + summary_lines(rep.fidelity)
    out += design_space_lines(rep.design_space)
    out += sceptic_lines(rep.sceptic)
    prov = rep.provenance
    if prov["plan_hashes"]:
        out.append(f"plan: {', '.join(h[:12] for h in prov['plan_hashes'])}; "
                   f"{len(prov['deviations'])} deviation(s) logged")
    out += [f"note: {n}" for n in rep.notes]
    return "\n".join(out)


def _convention(r: dict) -> str:
    """The comparison's prompt convention in a table cell: counted, on top (peers'), or MIXED."""
    conv = str(r.get("prompt_convention") or "prompt counted")
    return "MIXED" if conv.startswith("MIXED") else conv.removeprefix("prompt ")


def _where(r: dict) -> str:
    return f"{r['model']}/{_data(r)}/{_fmt_budget(r['budget'])}"


def code_lines(rep) -> list[str]:
    """The code version of the arms: one line when every arm ran on the same committed code, else
    one line per comparison naming both arms' versions and what is wrong."""
    versions = {v for r in rep.comparisons for v in (r.get("t_code_version"), r.get("b_code_version"))}
    if not any(r.get("code_flag") for r in rep.comparisons):
        return [f"code: {versions.pop()} (every arm)"] if len(versions) == 1 and None not in versions else []
    return [f"code {_where(r)} {r['treatment']} vs {r['baseline']}: treatment {r.get('t_code_version')}, "
            f"baseline {r.get('b_code_version')}" + (f" <- {r['code_flag']}" if r.get("code_flag") else "")
            for r in rep.comparisons]


def tests_used(rep) -> list[dict]:
    """The distinct tests of the comparison rows, each with its source and how many rows use it."""
    tests: dict = {}
    for r in rep.comparisons:
        key = (r["test_source"], r["boot_requested"], r["boot_max"], r["seed"], r["m"], r["alpha"])
        tests.setdefault(key, {"source": key[0], "boot": key[1], "boot_max": key[2], "seed": key[3],
                               "m": key[4], "alpha": key[5], "rows": 0})["rows"] += 1
    return list(tests.values())


def test_lines(rep) -> list[str]:
    """One line per test used: a confirmed cell's is the registered one, and says so."""
    return [f"{t['source']}: cluster bootstrap B={t['boot']} (max {t['boot_max']}) seed={t['seed']}, "
            f"Bonferroni over m={t['m']} at alpha={t['alpha']} ({t['rows']} comparison(s))"
            for t in tests_used(rep)]


def unconfirmed_banner(rep) -> list[str]:
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


def to_latex(rep) -> str:
    """LaTeX tables (booktabs rules only: \\toprule, \\midrule, \\bottomrule)."""
    main = [[tex_escape(_model(r["model"], r.get("t_model_quant"))), tex_escape(_data(r)),
             tex_escape(_pair_budget(rep, r)), tex_escape(r["treatment"]),
             tex_escape(r["baseline"]), tex_escape(r["accounting"]),
             f"{100 * r['acc_treatment']:.1f}", f"{100 * r['acc_baseline']:.1f}",
             f"{r['delta_pp']:+.1f}", f"[{r['ci95_lo_pp']:+.1f}, {r['ci95_hi_pp']:+.1f}]",
             f"[{r['ci_bonf_lo_pp']:+.1f}, {r['ci_bonf_hi_pp']:+.1f}]", _tex_p(r["p_bootstrap"]),
             _tex_p(r["p_bonferroni"]), tex_escape(r["verdict"]), str(r["k"]), str(r["n"]),
             matched_unit(_pair_arms(rep, r)), tex_escape(_measured(r, "t_")), tex_escape(_measured(r, "b_"))]
            for r in rep.comparisons]
    tests = tests_used(rep)
    level = (f"{100 * (1 - tests[0]['alpha'] / tests[0]['m']):.4g}\\% CI" if len(tests) == 1
             else "Bonferroni CI")
    described = "; ".join(f"{tex_escape(t['source'])}: $B={t['boot']}$ (max {t['boot_max']}), seed {t['seed']}, "
                          f"Bonferroni over $m={t['m']}$ cells at $\\alpha={t['alpha']}$" for t in tests)
    out = ["% Generated by `retention report`; needs \\usepackage{booktabs}.",
           _tabular(f"Paired accuracy per cell (cluster bootstrap over problems; {described}).",
                    "tab:retention-main", "llllllrrrccrrlrrlll",
                    ["Model", "Data", "Budget", "Treatment", "Baseline", "Acct.", "Acc.~T (\\%)",
                     "Acc.~B (\\%)", "$\\Delta$ (pp)", "95\\% CI",
                     level, "$p$", "$p_{\\mathrm{Bonf}}$", "Verdict", "$k$", "$n$", "Matched",
                     "Cache T", "Cache B"],
                    main)]
    arms = [[tex_escape(_model(a["model"], a.get("model_quant"))), tex_escape(_data(a)),
             tex_escape(budget_label(a)), tex_escape(a["label"]),
             tex_escape(a["accounting"]), tex_escape(a.get("prompt", "evict")), f"{100 * a['accuracy']:.1f}",
             _tex_num(a["cache_mean_tokens"], ".0f"), _tex_num(a["cache_peak_tokens"], ".0f"),
             _tex_num(a["kib_per_token"], ".1f"), _tex_num(a["mean_output_tokens"], ".0f"),
             _tex_num(100 * a["truncation_rate"], ".1f"), str(a["budget_exceeded"])]
            for a in rep.arms]
    out.append(_tabular("Measured cache and generation per arm.", "tab:retention-arms",
                        "llllllrrrrrrr",
                        ["Model", "Data", "Budget", "Arm", "Acct.", "Prompt", "Acc. (\\%)", "Mean cache",
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
    flagged = [r for r in rep.comparisons if r.get("code_flag")]
    if flagged:
        out.append("\\paragraph{Code.} " + " ".join(
            f"{tex_escape(r['model'])}/{tex_escape(_data(r))}/{_fmt_budget(r['budget'])} "
            f"{tex_escape(r['treatment'])} vs {tex_escape(r['baseline'])}: treatment "
            f"\\texttt{{{tex_escape(r.get('t_code_version'))}}}, baseline "
            f"\\texttt{{{tex_escape(r.get('b_code_version'))}}} ({tex_escape(r['code_flag'])})." for r in flagged))
        out.append("")
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


def write_report(rep, out_dir) -> list[Path]:
    """Write CSVs, LaTeX, JSON and figures into out_dir (each file replaced atomically).

    `report-files.json` lists what was written; files of an earlier report into the same folder
    that this one does not write (a figure of a cell no longer present) are removed, so a finished
    report never mixes two. Files the report did not write are never touched. While it writes,
    `REPORT-INCOMPLETE` says so and the listing (`"complete": false`) already names each file
    before it is written: a report killed half-way is marked, and the next one removes what the
    killed one left.
    """
    # deferred: pandas adds ~0.3 s to CLI start-up (the CLI imports this module)
    import pandas as pd

    out_dir = ensure_dir(Path(out_dir), "report folder")
    listing = out_dir / REPORT_LISTING
    previous = []
    if listing.exists():
        try:
            previous = [str(n) for n in load_json_object(listing, "report listing").get("files", [])]
        except ProtocolError:
            previous = []
    write_atomic(out_dir / INCOMPLETE, "retention report is writing this folder (or was killed while "
                                       "writing it): its files may mix two reports; rerun the report.\n")
    written = []

    def put(name: str, data: str | bytes) -> None:
        # write-ahead: the listing names the file before it exists, so a rerun can remove it
        pending = sorted({*previous, INCOMPLETE, *(p.name for p in written), name})
        write_atomic(listing, dumps({"files": pending, "complete": False}, indent=1) + "\n")
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
    if design_space_lines(rep.design_space):
        put("design_space.csv", pd.DataFrame(rep.design_space).to_csv(index=False))
    if rep.sceptic:
        put("diagnostics.csv", pd.DataFrame(rep.sceptic).to_csv(index=False))
    if any(r["compacted"] is not None or r["traced"] for r in rep.failure_modes):  # records of this harness
        put("failure_modes.csv", pd.DataFrame(rep.failure_modes).convert_dtypes().to_csv(index=False))
    put("report.tex", to_latex(rep))
    put("report.json", dumps(json_safe(rep.to_dict()), indent=1) + "\n")
    figures, figure_notes = report_figures.render_all(rep)
    for name, png in figures.items():
        put(name, png)
    rep.notes += [f"figure {n}" for n in figure_notes if f"figure {n}" not in rep.notes]
    names = {p.name for p in written}
    for stale in sorted(set(previous) - names - {INCOMPLETE}):
        path = out_dir / Path(stale).name  # names only: never a path outside out_dir
        if path.is_file():
            path.unlink()
    write_atomic(listing, dumps({"files": sorted(names)}, indent=1) + "\n")
    (out_dir / INCOMPLETE).unlink()
    return [*written, listing]


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
