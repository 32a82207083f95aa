"""The design-space table: each comparison grouped by the intervention families it changes.

A run's configuration names its mechanisms (docs/records.md): the scorer and its parameters
(scoring; its `routing` parameter counts as routing), and `cadence`, `routing`, `state`,
`decoding` when not at their defaults. The families of a comparison are those whose mechanism
differs between treatment and baseline; the table prints, per family, Δ vs the baseline at matched
memory with its CI and p (from the main table: the same test), and what each arm stored: mean
tokens per (layer, KV head) and mean KiB per sequence. "Matched memory" is the report's cell: runs
at the same budget (for an arm with `--budget-bytes` and a non-full state, the budget is the
full-precision tokens those KiB hold: `protocol.runs.Run.budget`).

The iso-cache diagnostic rides along each row: the same comparison under `prefill` accounting (the
published convention, where the budget is the cache right after a compaction and the mean is larger),
when the report holds it. A gain that holds under `prefill` but not under `mean` came from a larger
mean cache, not from the mechanism. A `prefill` comparison is listed as a row of its own only when no
`mean` (or `peak`) comparison of the same arms exists.
"""

from __future__ import annotations

import json

FAMILIES = ("scoring", "cadence", "routing", "state", "decoding")
MECHANISM_KEYS = ("cadence", "routing", "state", "decoding")


def _scoring(config: dict) -> str:
    params = {k: v for k, v in (config.get("scorer_params") or {}).items() if k not in ("stats", "routing")}
    return json.dumps([config.get("scorer"), params], sort_keys=True)


def families_of(treatment: dict, baseline: dict) -> list[str]:
    """The families whose mechanism differs between two run configurations (in `FAMILIES` order)."""
    out = []
    if _scoring(treatment) != _scoring(baseline):
        out.append("scoring")
    for fam in MECHANISM_KEYS:
        a, b = treatment.get(fam), baseline.get(fam)
        if fam == "routing":  # today's shared / per-layer is the scorer's own routing parameter
            a = a or (treatment.get("scorer_params") or {}).get("routing")
            b = b or (baseline.get("scorer_params") or {}).get("routing")
            a, b = (None if x in (None, "shared") else x for x in (a, b))
        if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            out.append(fam)
    return out


def mechanism_name(config: dict, family: str) -> str:
    """What an arm uses in `family` (the default's name when the key is absent)."""
    if family == "scoring":
        return str(config.get("scorer"))
    if family == "routing" and not config.get("routing"):
        return str((config.get("scorer_params") or {}).get("routing") or "native")
    entry = config.get(family)
    default = {"cadence": "fixed", "routing": "native", "state": "full", "decoding": "none"}[family]
    return default if entry is None else str(entry.get("name") if isinstance(entry, dict) else entry)


def design_space_rows(comparisons: list[dict], runs: list, arms: list[dict]) -> list[dict]:
    """One row per comparison, labelled with the families it changes (`"none"`: same mechanisms)."""
    by_id = {r.run_id: r for r in runs}
    arm_of = {a["run_id"]: a for a in arms}

    def same_arms(c: dict) -> tuple:
        return c["model"], c.get("dataset"), c["budget"], c["treatment"], c["baseline"]

    prefill = {same_arms(c): c for c in comparisons if c.get("accounting") == "prefill"}
    matched = {same_arms(c) for c in comparisons if c.get("accounting") != "prefill"}
    rows = []
    for c in comparisons:
        if c.get("accounting") == "prefill" and same_arms(c) in matched:
            continue  # shown as the iso-cache columns of its mean-accounting row
        iso = prefill.get(same_arms(c)) if c.get("accounting") != "prefill" else None
        t, b = by_id.get(c.get("treatment_run")), by_id.get(c.get("baseline_run"))
        if t is None or b is None:
            continue
        fams = families_of(t.config, b.config)
        ta, ba = arm_of.get(t.run_id, {}), arm_of.get(b.run_id, {})
        rows.append({
            "families": "+".join(fams) or "none", "model": c["model"], "dataset": c.get("dataset"),
            "budget": c["budget"], "treatment": c["treatment"], "baseline": c["baseline"],
            "budget_label": " vs ".join(dict.fromkeys(_label(a, c["budget"]) for a in (ta, ba))),
            "matched": "KiB" if any(a.get("budget_kib") is not None for a in (ta, ba)) else
                       "full" if c["budget"] is None else "tokens",
            "mechanisms": ", ".join(f"{f}={mechanism_name(t.config, f)}" for f in fams),
            "delta_pp": c["delta_pp"], "ci95_lo_pp": c["ci95_lo_pp"], "ci95_hi_pp": c["ci95_hi_pp"],
            "p_bootstrap": c["p_bootstrap"], "p_bonferroni": c["p_bonferroni"], "verdict": c["verdict"],
            "t_cache_mean_tokens": ta.get("cache_mean_tokens"), "b_cache_mean_tokens": ba.get("cache_mean_tokens"),
            "t_cache_mean_kib": ta.get("cache_mean_kib"), "b_cache_mean_kib": ba.get("cache_mean_kib"),
            "t_cache_mean_buffer_tokens": ta.get("cache_mean_buffer_tokens"),
            "b_cache_mean_buffer_tokens": ba.get("cache_mean_buffer_tokens"),
            "accounting": c.get("accounting"), "prompt_convention": c.get("prompt_convention"),
            "iso_prefill_delta_pp": iso["delta_pp"] if iso else None,
            "iso_prefill_p": iso["p_bootstrap"] if iso else None,
            "iso_prefill_cache_mean_tokens": iso.get("t_cache_mean_tokens") if iso else None,
        })
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(rows, key=lambda r: (min((order.get(f, 9) for f in r["families"].split("+")), default=9),
                                       r["model"], str(r["budget"]), r["treatment"]))


def design_space_lines(rows: list[dict]) -> list[str]:
    """The terminal table (printed when some comparison changes a family other than scoring)."""
    if not any(r["families"] not in ("scoring", "none") for r in rows):
        return []
    out = ["design space (Δ vs baseline at matched memory; cache: mean tokens per layer and KV head, KiB per "
           "sequence, treatment / baseline):"]
    for r in rows:
        out.append(f"  {r['families']:<9} {r['treatment']} vs {r['baseline']} ({r['model']}/{r['budget_label']}, "
                   f"matched in {r['matched']}): "
                   f"Δ {r['delta_pp']:+.2f} pp [{r['ci95_lo_pp']:+.1f}, {r['ci95_hi_pp']:+.1f}], "
                   f"p = {r['p_bootstrap']:.3g}, p_bonf = {r['p_bonferroni']:.3g}, {r['verdict']}; "
                   f"cache {_num(r['t_cache_mean_tokens'])} / {_num(r['b_cache_mean_tokens'])} tokens, "
                   f"{_num(r['t_cache_mean_kib'])} / {_num(r['b_cache_mean_kib'])} KiB; " + _buffers(r) + _iso(r)
                   + (f"; {r['prompt_convention']}" if r.get("prompt_convention") else ""))
    return out


def _buffers(r: dict) -> str:
    """This engine's buffer slots when they exceed the stored tokens (an allocating routing's holes)."""
    t, b = r.get("t_cache_mean_buffer_tokens"), r.get("b_cache_mean_buffer_tokens")
    padded = [(x, s) for x, s in ((t, r["t_cache_mean_tokens"]), (b, r["b_cache_mean_tokens"]))
              if x is not None and s is not None and x == x and x > s + 1e-9]
    return f"buffers {_num(t)} / {_num(b)} tokens (holes included); " if padded else ""


def _iso(r: dict) -> str:
    if r["accounting"] == "prefill":
        return "accounting prefill (no mean-accounting run of these arms: not matched memory)"
    if r["iso_prefill_delta_pp"] is None:
        return "iso-cache (prefill): not run"
    return (f"iso-cache (prefill): Δ {r['iso_prefill_delta_pp']:+.2f} pp, p = {r['iso_prefill_p']:.3g}, "
            f"{_num(r['iso_prefill_cache_mean_tokens'])} tokens")


def _label(arm: dict, budget) -> str:
    """An arm's budget as given: KiB for a `--budget-bytes` arm, never the token figure it was matched by."""
    kib = arm.get("budget_kib")
    return f"{float(kib):g} KiB" if kib is not None else "full" if budget is None else str(budget)


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"
