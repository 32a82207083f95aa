"""PNG figures of a report, drawn with matplotlib's Agg canvas (no pyplot, no global backend).

Each function takes plain report rows and returns PNG bytes; `render_all` picks the figures whose
inputs exist.
"""

from __future__ import annotations

import io

import numpy as np

_MARKERS = "osD^vP*Xh"


def _styles(keys) -> dict:
    """One colour and marker per arm key, the same in every panel and figure."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    keys = sorted(dict.fromkeys(keys))
    return {k: (cmap(i % 10), _MARKERS[i % len(_MARKERS)]) for i, k in enumerate(keys)}


def _budget_key(b):
    return (b is None, b or 0)


def _figure(ncols: int, width: float = 5.0, height: float = 4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    return buf.getvalue()


def accuracy_vs_cache(arms: list[dict]) -> bytes:
    """Accuracy (95% clustered CI) against measured mean cache tokens; one panel per model, one
    line per (arm label, accounting mode) joining its budgets."""
    models = list(dict.fromkeys(a["model"] for a in arms))
    styles = _styles((a["label"], a["accounting"]) for a in arms)
    fig, axes = _figure(len(models))
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
        ax.legend(fontsize=7)
    return _png(fig)


def cache_traces(traces: dict) -> bytes:
    """Per-step stored tokens (mean over records, 10-90% band) of each policy; one panel per
    (model, budget) cell, the budget as a dashed line."""
    models = list(dict.fromkeys(t["model"] for t in traces.values()))
    cells = sorted({(t["model"], t["budget"]) for t in traces.values()},
                   key=lambda c: (models.index(c[0]), _budget_key(c[1])))
    styles = _styles((t["label"], t["accounting"]) for t in traces.values())
    fig, axes = _figure(len(cells))
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
            ax.axhline(budget, color="grey", linestyle=":", label=f"budget {budget}")
        ax.set_title(f"{model}, budget {'full' if budget is None else budget}")
        ax.set_xlabel("decode step")
        ax.set_ylabel("stored tokens per layer and KV head")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _png(fig)


def effect_vs_n(subsets: list[dict]) -> bytes:
    """Paired effect (pp, 95% CI) on nested random subsets of problems against n."""
    fig, axes = _figure(1, width=6.0)
    ax = axes[0]
    groups: dict = {}
    for r in subsets:
        key = f"{r['model']}/{'full' if r['budget'] is None else r['budget']}: " \
              f"{r['treatment']} vs {r['baseline']} ({r['accounting']})"
        groups.setdefault(key, []).append(r)
    spread = 0.08 / max(len(groups) - 1, 1)
    for i, (key, rows) in enumerate(groups.items()):
        # dodge overlapping bars within +-4% of n (multiplicative, the axis is logarithmic)
        n = np.array([r["n"] for r in rows], float) * (1 - 0.04 + spread * i if len(groups) > 1 else 1)
        y = 100 * np.array([r["estimate"] for r in rows])
        lo = y - 100 * np.array([r["ci95_lo"] for r in rows])
        hi = 100 * np.array([r["ci95_hi"] for r in rows]) - y
        ax.errorbar(n, y, yerr=[lo, hi], marker=_MARKERS[i % len(_MARKERS)], capsize=3, label=key)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    sizes = sorted({r["n"] for r in subsets})
    ax.set_xticks(sizes, [str(v) for v in sizes])
    ax.minorticks_off()
    ax.set_xlabel("problems in nested random subset (n)")
    ax.set_ylabel("treatment - baseline (pp), 95% CI")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def proxy_vs_accuracy(proxy: list[dict]) -> bytes:
    """Accuracy against each proxy metric across configurations."""
    fig, axes = _figure(2)
    for ax, key, name in zip(axes, ("kl_mean", "top1_agreement"), ("mean KL to full cache",
                                                                   "top-1 agreement")):
        for p in proxy:
            ax.scatter(p[key], 100 * p["accuracy"])
            ax.annotate(f"{p['label']} B={p['budget']}", (p[key], 100 * p["accuracy"]),
                        fontsize=7, textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel(name)
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    return _png(fig)


def render_all(rep) -> dict[str, bytes]:
    """{file name: PNG bytes} for every figure whose inputs exist in the report."""
    out = {"accuracy_vs_cache.png": accuracy_vs_cache(rep.arms)}
    if rep.traces:
        out["cache_trace.png"] = cache_traces(rep.traces)
    if rep.subsets:
        out["effect_vs_n.png"] = effect_vs_n(rep.subsets)
    if rep.proxy:
        out["proxy_vs_accuracy.png"] = proxy_vs_accuracy(rep.proxy)
    return out
