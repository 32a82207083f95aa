"""Failure-mode findings as data: did an arm's mechanism run, and did the answer leave the full
cache's path after the problem statement was evicted?

Per run (one arm of one cell), from its records (docs/records.md):

* `compacted`: records with `compactions > 0`, and `compacted_share` of all records. A record that
  ends before its first compaction never tested the mechanism; an evicting arm where fewer than
  `CONTROL_SHARE` of the records compacted is a control, not a result, and the report says so in a
  note (None when the records carry no `compactions`, e.g. hand-made ones).
* With cache traces (`--trace`: records carry `prompt_evicted_step`): `prompt_evicted`, the records
  in which some prompt position was evicted from some (layer group, KV head).
* Against the full cache: the `full` run of the same model, split, dataset and decoding settings
  (`REFERENCE_KEYS`), its record of the same (problem, sample) with the same seed. For each such
  pair, the record *departed* when its extracted answer differs from the full record's (two
  records without an extracted answer agree). Its *divergence token* `d` is the index of the first
  output token that differs from the full record's (the shorter length when one output is a prefix
  of the other). The prompt eviction at step `e` (`prompt_evicted_step`: `e` output tokens had been
  generated) can influence output token `e + 1` at the earliest (the compaction follows the forward
  that produced token `e`'s logits), so a departure is *after eviction* when `e` is not null and
  `e < d`, and *before eviction* otherwise (evicted later than the divergence, or never).
  `departed_after_eviction + departed_before_eviction = departed`; both null without traces.
"""

from __future__ import annotations

from protocol.runs import Run

CONTROL_SHARE = 0.5
# What makes the full run's tokens the same path as the arm's until the cache makes them differ.
REFERENCE_KEYS = ("model", "split", "dataset", "dtype", "temperature", "top_p", "max_new_tokens", "seed",
                  "ignore_eos", "prompt", "engine", "model_quant")

COLUMNS = ("label", "model", "budget", "split", "records", "compacted", "compacted_share", "traced",
           "prompt_evicted", "reference", "paired", "departed", "departed_after_eviction",
           "departed_before_eviction")


def divergence_token(a: list[int], b: list[int]) -> int | None:
    """Index of the first output token where `a` and `b` differ (the shorter length when one is a
    prefix of the other); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def departed_after_eviction(evicted_step: int | None, divergence: int | None) -> bool:
    """Whether the prompt was evicted early enough to have shaped the first differing token."""
    return evicted_step is not None and divergence is not None and evicted_step < divergence


def _reference(run: Run, runs: list[Run]) -> Run | None:
    """The `full` run this run's tokens are compared with (same plan preferred), or None."""
    same = [r for r in runs if r is not run and r.scorer == "full" and r.config.get("budget") is None
            and all(r.config.get(k) == run.config.get(k) for k in REFERENCE_KEYS)]
    same.sort(key=lambda r: r.plan_hash != run.plan_hash)
    return same[0] if same else None


def _key(rec: dict) -> tuple[str, int]:
    return str(rec["problem_id"]), int(rec["sample"])


def failure_row(run: Run, reference: Run | None) -> dict:
    """The module docstring's figures for one run (a dict of `COLUMNS`)."""
    recs = run.records
    n = len(recs)
    counted = [r for r in recs if isinstance(r.get("compactions"), int)]
    compacted = sum(1 for r in counted if r["compactions"] > 0) if counted else None
    traced = [r for r in recs if "prompt_evicted_step" in r]
    row = {"label": run.label, "model": run.model, "budget": run.budget, "split": run.split, "records": n,
           "compacted": compacted, "compacted_share": compacted / n if compacted is not None and n else None,
           "traced": len(traced),
           "prompt_evicted": sum(1 for r in traced if r["prompt_evicted_step"] is not None) if traced else None,
           "reference": None if reference is None else reference.label, "paired": None, "departed": None,
           "departed_after_eviction": None, "departed_before_eviction": None}
    if reference is None or run is reference:
        return row
    full = {_key(r): r for r in reference.records}
    pairs = [(r, full[_key(r)]) for r in recs if _key(r) in full
             and (r.get("seed") is None or full[_key(r)].get("seed") in (None, r.get("seed")))]
    departed = [(r, f) for r, f in pairs if r.get("extracted") != f.get("extracted")]
    row.update(paired=len(pairs), departed=len(departed))
    if traced and len(traced) == n:
        after = sum(1 for r, f in departed if departed_after_eviction(r["prompt_evicted_step"], divergence_token(
            r.get("output_token_ids") or [], f.get("output_token_ids") or [])))
        row.update(departed_after_eviction=after, departed_before_eviction=len(departed) - after)
    return row


def failure_modes(runs: list[Run]) -> tuple[list[dict], list[str]]:
    """(one row per run, the notes the report prints): the control warning for an evicting arm that
    mostly never compacted, and the departure counts of traced arms."""
    rows, notes = [], []
    for run in runs:
        row = failure_row(run, _reference(run, runs))
        rows.append(row)
        where = f"{run.label} ({run.model}, budget {run.budget}, split {run.split})"
        share = row["compacted_share"]
        if run.config.get("budget") is not None and share is not None and share < CONTROL_SHARE:
            notes.append(f"{where}: {row['records'] - row['compacted']} of {row['records']} records never "
                         "compacted (they ended before the first compaction): this arm is a control, not a result")
        if row["departed_after_eviction"] is not None:
            notes.append(f"{where}: prompt evicted in {row['prompt_evicted']} of {row['records']} records; answer "
                         f"departed from {row['reference']} in {row['departed']} of {row['paired']} paired records, "
                         f"{row['departed_after_eviction']} after the prompt was evicted and "
                         f"{row['departed_before_eviction']} before (or never evicted)")
    return rows, notes
