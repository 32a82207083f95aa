"""Print the budget ladder's table (issue 44, item 3) from a folder of runs, as the results README holds it.

One row per arm (labelled as the report labels it), ordered by budget then label: accuracy (correct of n), acc_strict, truncated, looping,
compacted and answer-after-first-compaction shares, the prompt held at the end, the mean cache and the
mean output length, all from `protocol.diagnostics` (the report's own code); then the full cache's
truncation at shorter token limits (an answer of the full arm that stopped before L tokens stops at the
same place under a limit of L: the sampling stream of a problem is seeded per problem, so its first L
tokens do not depend on the limit). `tests/committed/test_ladder.py` recomputes every figure from the
records with code of its own.

    python scripts/ladder_table.py results/ladder-qwen1.5b/runs
"""

from __future__ import annotations

import sys
from pathlib import Path

from protocol.diagnostics import sceptic_diagnostics, summarize_run
from protocol.runs import assign_labels, find_run_dirs, load_run


def pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}"


def cut_at(rec: dict, limit: int) -> bool:
    """Whether an answer would be cut off under a limit of `limit` new tokens (its ids end with the end of
    sequence when it stopped by itself, so one of exactly `limit` tokens stopped in time)."""
    n = int(rec["output_tokens"])
    return n > limit or (n == limit and rec.get("finish_reason") == "length")


def rows(folder: Path) -> list[str]:
    runs = [load_run(d, with_trace=True) for d in find_run_dirs([folder])]
    assign_labels(runs)  # the arm's name: its scorer and what sets it apart (routing, state, cadence, ...)
    runs.sort(key=lambda r: (r.budget if isinstance(r.budget, (int, float)) else 1e9, r.label))
    out = ["| arm | budget | acc % (correct/n) | acc_strict % | truncated % | looping % | compacted % "
           "| answer after 1st compaction % | prompt held at end % | mean cache (tokens) | mean output tokens |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        s, d = summarize_run(run), sceptic_diagnostics(run)
        n, right = s["n_records"], round(s["accuracy"] * s["n_records"])
        out.append(f"| {run.label} | {run.budget if run.budget is not None else 'full'} | {pct(s['accuracy'])} "
                   f"({right}/{n}) | {pct(d['acc_strict'])} | {pct(d['truncated_share'])} | {pct(d['looping_share'])} "
                   f"| {pct(d['compacted_share'])} | {pct(d['after_compaction_share'])} | {pct(d['prompt_held_final'])} "
                   f"| {s['cache_mean_tokens']:.1f} | {s['mean_output_tokens']:.0f} |")
    full = [r for r in runs if r.scorer == "full"]
    if full:
        recs = full[0].records
        limit = int(full[0].config["max_new_tokens"])
        out.append("")
        out.append("full cache, truncated at a limit of L new tokens: " + ", ".join(
            f"L={L}: {pct(sum(cut_at(r, L) for r in recs) / len(recs))}%"
            for L in (512, 768, limit)))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: python scripts/ladder_table.py RUNS_FOLDER")
    print("\n".join(rows(Path(sys.argv[1]))))
