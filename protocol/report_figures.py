"""PNG figures of a report, drawn with matplotlib's Agg canvas (no pyplot, no global backend).

Each function takes plain report rows and returns PNG bytes; `render_all` picks the figures whose
inputs exist.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

_MARKERS = "osD^vP*Xh"


def _styles(keys) -> dict:
    """One colour and marker per arm key, the same in every panel and figure."""
    # deferred: matplotlib (~0.3 s), only when a report draws its figures
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    keys = sorted(dict.fromkeys(keys))
    return {k: (cmap(i % 10), _MARKERS[i % len(_MARKERS)]) for i, k in enumerate(keys)}


def _budget_key(b):
    return (b is None, b or 0)


def _grid(panels: int, n_legend: int, longest: int, *, width: float = 5.0, height: float = 3.6,
          max_cols: int = 3):
    """A figure of `panels` axes wrapped into rows of at most `max_cols`, tall enough for a shared
    legend of `n_legend` entries (the longest `longest` characters) below them: however many arms
    a report holds, the axes keep their size and no label is drawn over another."""
    # deferred: matplotlib (~0.3 s), only when a report draws its figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = max(1, min(panels, max_cols))
    nrows = -(-panels // ncols)
    fig_w = max(width * ncols, 7.0)
    per_row = max(1, int(fig_w * 72 / (7 * 0.6 * longest + 40)))  # 7-pt text, ~0.6 em per char
    leg_cols = max(1, min(n_legend, per_row))
    leg_rows = -(-n_legend // leg_cols) if n_legend else 0
    fig = Figure(figsize=(fig_w, height * nrows + 0.2 * leg_rows + 0.3), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[panels:]:
        ax.set_visible(False)
    return fig, list(axes[:panels]), leg_cols


def _shared_legend(fig, axes, ncols: int) -> None:
    """One legend below all panels, each entry once."""
    seen: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncols=ncols, fontsize=7,
                   frameon=False)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return buf.getvalue()


def accuracy_vs_cache(arms: list[dict]) -> bytes:
    """Accuracy (95% clustered CI) against measured mean cache tokens; one panel per model, one
    line per (arm label, accounting mode) joining its budgets."""
    models = list(dict.fromkeys(a["model"] for a in arms))
    styles = _styles((a["label"], a["accounting"]) for a in arms)
    names = [f"{label} ({acct})" for label, acct in styles]
    fig, axes, leg_cols = _grid(len(models), len(names), max(map(len, names)))
    for ax, model in zip(axes, models):
        groups: dict = {}
        for a in arms:
            if a["model"] == model:
                groups.setdefault((a["label"], a["accounting"]), []).append(a)
        for (label, acct), pts in sorted(groups.items()):
            colour, marker = styles[(label, acct)]
            pts = sorted(pts, key=lambda a: a["cache_mean_tokens"])
            x = np.array([a["cache_mean_tokens"] for a in pts], float)
            y = 100 * np.array([a["accuracy"] for a in pts])
            lo = y - 100 * np.array([a["acc_ci95_lo"] for a in pts])
            hi = 100 * np.array([a["acc_ci95_hi"] for a in pts]) - y
            ax.errorbar(x, y, yerr=[lo, hi], marker=marker, color=colour, capsize=3,
                        linestyle="--" if acct == "prefill" else "-", label=f"{label} ({acct})")
            for a, xi, yi in zip(pts, x, y):
                b = "full" if a["budget"] is None else f"B={a['budget']}"
                ax.annotate(b, (xi, yi), textcoords="offset points", xytext=(4, -10), fontsize=7)
        ax.set_title(str(model))
        ax.set_xlabel("measured mean cache (tokens per layer and KV head)")
        ax.set_ylabel("accuracy (%), 95% CI")
        ax.set_ylim(-3, 103)  # the whole scale: a flat 0% must not look like noise around zero
        ax.margins(x=0.12)  # room for the budget labels at the edges
        ax.grid(alpha=0.3)
    _shared_legend(fig, axes, leg_cols)
    return _png(fig)


def cache_traces(traces: dict) -> bytes:
    """Per-step stored tokens (mean over records, 10-90% band) of each policy; one panel per
    (model, budget) cell, the budget as a dashed line."""
    models = list(dict.fromkeys(t["model"] for t in traces.values()))
    cells = sorted({(t["model"], t["budget"]) for t in traces.values()},
                   key=lambda c: (models.index(c[0]), _budget_key(c[1])))
    styles = _styles((t["label"], t["accounting"]) for t in traces.values())
    names = [f"{label} ({acct})" for label, acct in styles]
    fig, axes, leg_cols = _grid(len(cells), len(names) + 1, max(map(len, names)))
    for ax, (model, budget) in zip(axes, cells):
        for t in sorted(traces.values(), key=lambda t: (t["label"], t["accounting"])):
            if (t["model"], t["budget"]) != (model, budget):
                continue
            grid = np.asarray(t["grid"])
            colour, _marker = styles[(t["label"], t["accounting"])]
            ax.plot(grid, t["mean"], color=colour, linestyle="--" if t["accounting"] == "prefill" else "-",
                    label=f"{t['label']} ({t['accounting']})")
            ax.fill_between(grid, t["lo"], t["hi"], color=colour, alpha=0.15, linewidth=0)
        if budget is not None:
            ax.axhline(budget, color="grey", linestyle=":", label="budget")
        ax.set_title(f"{model}, budget {'full' if budget is None else budget}")
        ax.set_xlabel("decode step")
        ax.set_ylabel("stored tokens per layer and KV head")
        ax.grid(alpha=0.3)
    _shared_legend(fig, axes, leg_cols)
    return _png(fig)


def effect_vs_n(subsets: list[dict]) -> bytes:
    """Paired effect (pp, 95% CI) on nested random subsets of problems against n: one panel per
    (model, budget) cell, one colour per comparison, named in one legend below the panels."""
    models = list(dict.fromkeys(r["model"] for r in subsets))
    cells = sorted({(r["model"], r["budget"]) for r in subsets},
                   key=lambda c: (models.index(c[0]), _budget_key(c[1])))
    name = lambda r: f"{r['treatment']} vs {r['baseline']} ({r['accounting']})"  # noqa: E731
    styles = _styles(name(r) for r in subsets)
    fig, axes, leg_cols = _grid(len(cells), len(styles), max(map(len, styles)))
    sizes = sorted({r["n"] for r in subsets})
    for ax, cell in zip(axes, cells):
        groups: dict = {}
        for r in subsets:
            if (r["model"], r["budget"]) == cell:
                groups.setdefault(name(r), []).append(r)
        spread = 0.08 / max(len(groups) - 1, 1)
        for i, (key, rows) in enumerate(sorted(groups.items())):
            # dodge overlapping bars within +-4% of n (multiplicative, the axis is logarithmic)
            n = np.array([r["n"] for r in rows], float) * (1 - 0.04 + spread * i if len(groups) > 1 else 1)
            y = 100 * np.array([r["estimate"] for r in rows])
            lo = y - 100 * np.array([r["ci95_lo"] for r in rows])
            hi = 100 * np.array([r["ci95_hi"] for r in rows]) - y
            colour, marker = styles[key]
            ax.errorbar(n, y, yerr=[lo, hi], marker=marker, color=colour, capsize=3, label=key)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks(sizes, [str(v) for v in sizes])
        ax.minorticks_off()
        ax.set_title(f"{cell[0]}, budget {'full' if cell[1] is None else cell[1]}")
        ax.set_xlabel("problems in nested random subset (n)")
        ax.set_ylabel("treatment - baseline (pp), 95% CI")
        ax.grid(alpha=0.3)
    _shared_legend(fig, axes, leg_cols)
    return _png(fig)


def proxy_vs_accuracy(proxy: list[dict]) -> bytes:
    """Accuracy against each proxy metric across configurations: one colour and marker per arm
    (model, label, accounting), its budgets joined in order and told apart by marker size (larger
    = larger budget); arms are named in one legend below the panels, never beside the points."""
    models = list(dict.fromkeys(p["model"] for p in proxy))
    arm = (lambda p: (f"{p['model']}: " if len(models) > 1 else "")  # noqa: E731
           + f"{p['label']} ({p['accounting']})")
    names = sorted({arm(p) for p in proxy})
    styles = _styles(names)
    budgets = sorted({p["budget"] for p in proxy}, key=_budget_key)
    size = {b: 25 + 55 * i / max(len(budgets) - 1, 1) for i, b in enumerate(budgets)}
    fig, axes, leg_cols = _grid(2, len(names), max(map(len, names)), width=5.5, height=4.0)
    for ax, key, title in zip(axes, ("kl_mean", "top1_agreement"), ("mean KL to full cache",
                                                                    "top-1 agreement")):
        for name in names:
            pts = sorted((p for p in proxy if arm(p) == name and np.isfinite(p[key])),
                         key=lambda p: _budget_key(p["budget"]))
            if not pts:
                continue
            colour, marker = styles[name]
            x = [p[key] for p in pts]
            y = [100 * p["accuracy"] for p in pts]
            ax.plot(x, y, color=colour, linewidth=0.8, alpha=0.6)
            ax.scatter(x, y, s=[size[p["budget"]] for p in pts], color=colour, marker=marker,
                       label=name, edgecolors="black", linewidths=0.4)
        ax.set_xlabel(title)
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    if len(budgets) > 1:
        fig.suptitle("marker size: budget " + " < ".join("full" if b is None else str(b) for b in budgets),
                     fontsize=8)
    _shared_legend(fig, axes, leg_cols)
    return _png(fig)


def render_all(rep) -> tuple[dict[str, bytes], list[str]]:
    """({file name: PNG bytes} for every figure whose inputs exist in the report, notes).

    Warnings raised while drawing (matplotlib's layout engine, numpy on empty data) are returned as
    notes for the report instead of reaching stderr, where only the one `Error:` line may appear."""
    makers = {"accuracy_vs_cache.png": (accuracy_vs_cache, rep.arms)}
    if rep.traces:
        makers["cache_trace.png"] = (cache_traces, rep.traces)
    if rep.subsets:
        makers["effect_vs_n.png"] = (effect_vs_n, rep.subsets)
    if rep.proxy:
        makers["proxy_vs_accuracy.png"] = (proxy_vs_accuracy, rep.proxy)
    out, notes = {}, []
    for name, (draw, rows) in makers.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[name] = draw(rows)
        notes += [f"{name}: {w.message}" for w in caught]
    return out, list(dict.fromkeys(notes))
