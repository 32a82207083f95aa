"""What the viewer shows, extracted from loaded runs and their report (no HTML here: `site` writes it).

* `site_data(runs, report, ...)`: the index (arms with the report's per-arm figures, the report's
  comparison rows with their paired tests, one row per (problem, sample) with each arm's verdict,
  whether its answer changed against the full cache and where its tokens left the full cache's) and
  one payload per (problem, sample) with every arm's record, loaded by the browser only when opened.
* Statistics are never recomputed here: the figures are the report's (`protocol.report`), or, for
  runs that form no comparison, `protocol.diagnostics.summarize_run`'s.
* The full-cache reference of a budgeted run, the divergence token and a changed answer are those of
  the report's failure-mode counts (`protocol.failure_modes`): the `full` run of the same model,
  split, dataset and decoding settings; records pair by (problem_id, sample).
* Token boundaries: `pieces(model)` (optional, from the CLI: the run's tokenizer when it is at hand)
  gives the decoded text of each output token; without it the browser splits the text approximately.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from protocol.comparisons import budget_key
from protocol.data import load_dataset
from protocol.diagnostics import summarize_run
from protocol.errors import ProtocolError
from protocol.failure_modes import _reference, divergence_token
from protocol.render import json_safe, test_lines
from protocol.run_types import check_run
from protocol.runs import Run
from protocol.viewer.cachemap import cache_map

#: Fields of the report's comparison rows that the index shows.
COMPARISON_FIELDS = ("model", "dataset", "budget", "split", "accounting", "treatment", "baseline", "n", "k",
                     "acc_treatment", "acc_baseline", "delta_pp", "ci95_lo_pp", "ci95_hi_pp", "ci_bonf_lo_pp",
                     "ci_bonf_hi_pp", "p_bootstrap", "p_bonferroni", "verdict", "confirmation", "test_source")
#: Fields of a per-arm summary (`summarize_run`) that the index shows.
ARM_FIELDS = ("label", "model", "dataset", "budget", "scorer", "accounting", "split", "run_id", "n_problems",
              "n_records", "accuracy", "acc_ci95_lo", "acc_ci95_hi", "cache_mean_tokens", "cache_peak_tokens",
              "mean_output_tokens", "truncation_rate", "kl_mean", "top1_agreement", "first_divergence_median",
              "ungradable", "path")
RECORD_FIELDS = ("finish_reason", "verdict", "extracted", "reason", "rule", "prompt_tokens", "output_tokens",
                 "cache_mean_tokens", "cache_peak_tokens", "compactions", "prompt_evicted_step",
                 "prompt_held_final", "fidelity", "seed")

Pieces = Callable[[list[int]], list[str]]


@dataclass(frozen=True)
class Arm:
    """One run in the viewer: `key` names it in the site's data (a0, a1, ...); `ref` is the key of
    its full-cache reference run, or None (it is one, or there is none)."""

    key: str
    run: Run
    ref: str | None


@dataclass(frozen=True)
class SiteData:
    """`index`: the index page's data; `problems`: (pid, sample) of each per-problem payload, in order;
    `payload(i)` builds payload i (built one at a time, so a confirm run never sits in memory twice)."""

    index: dict
    problems: list
    arms: tuple
    records: dict   # arm key -> {(problem_id, sample): record}
    traces: dict    # arm key -> {(problem_id, sample): trace line}, for the runs with a trace.jsonl
    pieces: dict    # arm key -> Pieces | None
    statements: dict

    def payload(self, i: int) -> dict:
        pid, sample = self.problems[i]
        recs = {a.key: self.records[a.key].get((pid, sample)) for a in self.arms}
        out = {"id": i, "pid": pid, "sample": sample, "statement": self.statements.get(pid),
               "gold": next((r.get("gold") for r in recs.values() if r is not None and r.get("gold") is not None),
                            None), "arms": {}}
        for arm in self.arms:
            rec = recs[arm.key]
            if rec is None:
                continue
            ref = recs.get(arm.ref) if arm.ref else None
            line = self.traces[arm.key].get((pid, sample)) if arm.key in self.traces else None
            out["arms"][arm.key] = record_view(rec, line, ref, self.pieces[arm.key], _trace_state(arm.run))
        return out  # strict JSON already (records and traces are read strictly; `site` writes strictly)

    def payloads(self) -> Iterator[tuple[int, dict]]:
        for i in range(len(self.problems)):
            yield i, self.payload(i)


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units (JavaScript string indices)."""
    return len(text.encode("utf-16-le")) // 2


def common_prefix(a: str, b: str) -> int:
    """Length (UTF-16 units) of the longest common prefix of two texts."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return utf16_len(a[:n])


def token_lengths(pieces: list[str], text: str) -> dict | None:
    """{"o": offset of the first token's text, "lens": UTF-16 length of each token's text} when the
    pieces spell the record's text (after a prefix the runtime adds, e.g. `<think>\\n`), else None."""
    joined = "".join(pieces)
    if not text.endswith(joined):
        return None
    return {"o": utf16_len(text[:len(text) - len(joined)]), "lens": [utf16_len(p) for p in pieces]}


def record_view(rec: dict, line: dict | None, ref: dict | None, pieces: Pieces | None,
                trace_state: str = "none") -> dict:
    """One arm's record of a (problem, sample) as the problem page shows it. `trace`: "ok", or why there
    is no cache map: "none" (its trace line holds none), or, without a line, `trace_state` ("none": the run
    was not traced; "missing": it was, and this record has no trace line; "truncated": it was, and its
    trace file ended in a half-written line)."""
    text = rec.get("text") or ""
    ids = [int(t) for t in rec.get("output_token_ids") or []]
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    out.update(text=text, n_tokens=len(ids), tokens=None)
    if pieces is not None and ids:
        out["tokens"] = token_lengths(pieces(ids), text)
    if ref is not None:
        ref_ids = [int(t) for t in ref.get("output_token_ids") or []]
        out["div"] = {"token": divergence_token(ids, ref_ids), "char": common_prefix(text, ref.get("text") or ""),
                      "changed": answer_changed(rec, ref)}
    cache = (line or {}).get("cache")
    out["trace"] = "ok" if isinstance(cache, dict) else "none" if line is not None else trace_state
    if out["trace"] == "ok":
        try:
            out["map"] = cache_map(cache)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"record {rec.get('problem_id')!r} sample {rec.get('sample')}: malformed cache "
                                f"trace ({type(exc).__name__}: {exc})") from None
        out["kl"], out["top1"] = cache.get("kl"), cache.get("top1")  # rounded by the trace already
    return out


def _trace_state(run: Run) -> str:
    """What a record of `run` without a trace line means: the run was not traced ("none"), or it was
    and the line is missing ("missing"), or the trace file ended in a half-written line ("truncated")."""
    if not run.meta.get("trace"):
        return "none"
    if any("dropped a half-written last line" in w and "trace" in w for w in run.warnings):
        return "truncated"
    return "missing"


def answer_changed(rec: dict, ref: dict) -> bool:
    """The extracted answer differs from the full cache's: a departure, as `protocol.failure_modes`
    counts it (both missing: unchanged)."""
    return rec.get("extracted") != ref.get("extracted")


def _statements(runs: list[Run]) -> dict:
    """Problem statements by id from the runs' datasets (the shipped copies; none when unreadable)."""
    out: dict = {}
    for dataset, data in {(r.dataset, r.config.get("data")) for r in runs}:
        try:
            problems = load_dataset(dataset, data if dataset == "math500" else None)
        except (ProtocolError, OSError):
            continue
        out.update({p.unique_id: p.problem for p in problems})
    return out


def _trace_lines(run: Run) -> dict | None:
    """(problem_id, sample) -> trace line (the last one wins, docs/records.md), or None without a trace."""
    if run.trace is None:
        return None
    return {(str(t.get("problem_id")), int(t.get("sample", 0))): t for t in run.trace}


def _comparisons(report, keys: dict) -> list[dict]:
    fid: dict = {}
    for f in report.fidelity:
        fid.setdefault((f["model"], f["budget"], f["treatment"], f["baseline"]), []).append(
            {k: f[k] for k in ("metric", "mean_treatment", "mean_baseline", "estimate", "ci95_lo", "ci95_hi",
                               "p_bootstrap", "n", "boot")})
    rows = []
    for row in report.comparisons:
        entry = {k: row.get(k) for k in COMPARISON_FIELDS}
        entry.update(t=keys.get(row["treatment_run"]), b=keys.get(row["baseline_run"]),
                     fidelity=fid.get((row["model"], row["budget"], row["treatment"], row["baseline"]), []))
        rows.append(entry)
    return rows


def site_data(runs: list[Run], report=None, *, pieces: Callable[[str], Pieces | None] | None = None,
              title: str = "retention viewer", notes=(), figures=()) -> SiteData:
    """The viewer's data for `runs` (labelled, as `protocol.runs.assign_labels` leaves them) and their
    `report` (`protocol.report.Report`, or None when the runs form no comparison).

    pieces: model name -> a function decoding output token ids into per-token texts (None: no tokenizer)."""
    if not runs:
        raise ProtocolError("nothing to view: no runs")
    for run in runs:  # every number the page shows is a number (`protocol.run_types`)
        check_run(run)
    models = list(dict.fromkeys(r.model for r in runs))
    ordered = sorted(runs, key=lambda r: (models.index(r.model), budget_key(r.budget), str(r.split), r.label,
                                          r.accounting))
    keys = {id(r): f"a{i}" for i, r in enumerate(ordered)}
    summaries = {a["run_id"]: a for a in report.arms} if report is not None else {}
    arms, arm_rows = [], []
    decoders = {m: pieces(m) if pieces is not None else None for m in models}
    for run in ordered:
        ref = _reference(run, ordered) if run.budget is not None else None
        arm = Arm(keys[id(run)], run, keys[id(ref)] if ref is not None else None)
        arms.append(arm)
        summary = summaries.get(run.run_id) or summarize_run(run)
        arm_rows.append({"key": arm.key, "ref": arm.ref, "traced": bool(run.meta.get("trace")),
                         "tokenizer": decoders[run.model] is not None, **{k: summary.get(k) for k in ARM_FIELDS}})
    records = {a.key: {(str(r["problem_id"]), int(r["sample"])): r for r in a.run.records} for a in arms}
    problems = sorted({k for recs in records.values() for k in recs})
    rows = []
    for i, key in enumerate(problems):
        cells = []
        for arm in arms:
            rec = records[arm.key].get(key)
            ref = records[arm.ref].get(key) if arm.ref and rec else None
            if rec is None:
                cells.append(None)
                continue
            verdict = None if rec.get("verdict") is None else int(bool(rec["verdict"]))
            div = divergence_token(rec.get("output_token_ids") or [], ref.get("output_token_ids") or []) if ref else None
            cells.append([verdict, None if ref is None else int(answer_changed(rec, ref)),
                          None if ref is None else (-1 if div is None else div)])
        rows.append([i, key[0], key[1], cells])
    index = {"title": title, "arms": arm_rows, "problems": rows, "figures": list(figures),
             "comparisons": _comparisons(report, {r.run_id: keys[id(r)] for r in ordered}) if report else [],
             "tests": test_lines(report) if report is not None and report.comparisons else [],
             "notes": list(notes) + (list(report.notes) if report is not None else [])}
    traces = {keys[id(r)]: t for r in ordered if (t := _trace_lines(r)) is not None}
    return SiteData(index=json_safe(index), problems=problems, arms=tuple(arms), records=records, traces=traces,
                    pieces={a.key: decoders[a.run.model] for a in arms}, statements=_statements(ordered))
