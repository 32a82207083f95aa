"""Run directories for reports: loading, arm identity, labels, and pairing two runs.

Input: run directories (docs/records.md): `config.json`, `records.jsonl` (or shard files), optionally
`trace.jsonl` and, for confirm runs, `confirm.json`. Records of two runs are paired by
(problem_id, sample).

Identity never uses a path. A run is its `config_hash` plus its split: the same run reached twice
under two paths (a run directory and its merged copy, a shard and its merge) is refused by
`refuse_duplicates`, naming both paths; the same path given twice is one run. An *arm* is the
scorer plus its declared parameters (prompt rule, engine, plugin identity); the calibration
statistics are identified by content (`stats_sha256`, or `scorer_params.stats` = "sha256:<hex>")
and are not part of the arm, since each model has its own: the arm `triattention` of a two-model
study is one arm with two statistics files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from protocol import grading, shards, stats
from protocol.design_space import MECHANISM_KEYS
from protocol.errors import ProtocolError
from protocol.io import config_hash, load_json_object, read_jsonl


def stats_identity(config: dict) -> str | None:
    """sha256 hex of a run's calibration statistics (None when the scorer takes none).

    `stats_sha256` when recorded; else `scorer_params.stats` when it is a content hash
    ("sha256:<hex>"); else (an old run that recorded only a path) the recorded value itself, used
    to tell runs apart but never shown."""
    if config.get("stats_sha256"):
        return str(config["stats_sha256"])
    value = (config.get("scorer_params") or {}).get("stats")
    if value is None:
        return None
    value = str(value)
    return value.split(":", 1)[1] if value.startswith("sha256:") else value


def declared_params(config: dict) -> dict:
    """A run's scorer parameters without the statistics (identified by content, not by name)."""
    return {k: v for k, v in (config.get("scorer_params") or {}).items() if k != "stats"}


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
    label_parts: list = field(default_factory=list)  # the parameters shown in the label

    @property
    def run_id(self) -> str:
        return str(self.meta.get("run_id") or self.path.name)

    @property
    def prompt_rule(self) -> str:
        """What the arm did with the prompt (docs/random-control.md): "evict" (an ordinary candidate),
        "keep" (protected, counted inside b), "keep-on-top" (protected on top of b)."""
        return prompt_rule(self.config)

    @property
    def model(self) -> str:
        return str(self.config.get("model"))

    @property
    def budget(self):
        """The cell's memory budget in tokens: the run's `budget`, except for a run given in KiB
        (`budget_kib`) whose state stores tokens in another representation: there, the tokens those
        KiB hold in full precision, so that it is compared at matched memory."""
        kib, state = self.config.get("budget_kib"), self.config.get("state")
        if kib is not None and state is not None and self.records:
            per_token = self.records[0].get("kib_per_token")
            if per_token:
                return int(float(kib) // float(per_token) + 1e-9)
        return self.config.get("budget")

    @property
    def scorer(self) -> str:
        return str(self.config.get("scorer"))

    @property
    def accounting(self) -> str:
        return str(self.config.get("accounting") or "mean")

    @property
    def split(self):
        return self.config.get("split")

    @property
    def dataset(self) -> str:
        return str(self.config.get("dataset") or "math500")

    @property
    def cell(self) -> tuple:
        """(model, budget, split, dataset): runs are compared only within one cell."""
        return (self.model, self.budget, self.split, self.dataset)

    @property
    def identity(self) -> tuple:
        """What makes two directories the same run (never their paths)."""
        return (str(self.meta.get("config_hash") or self.run_id), self.split)

    @property
    def arm_signature(self) -> str:
        """Scorer and declared parameters: what makes two runs the same arm in different cells."""
        engine = self.config.get("engine")  # a run of another engine (run --engine) is another arm
        prompt = "+protect-prompt" if self.config.get("protect_prompt") else ""  # the reference's prompt rule
        counted = self.config.get("protect_prompt_counted")  # absent on runs before the key: as before
        prompt += "" if counted is None else f"+prompt-counted={str(bool(counted)).lower()}"
        plugin = self.config.get("scorer_plugin")
        # A non-default cadence, routing, state or decoding is another arm (absent keys: as before).
        mechanisms = {k: self.config[k] for k in MECHANISM_KEYS if self.config.get(k) is not None}
        return (self.scorer + json.dumps(declared_params(self.config), sort_keys=True) + prompt
                + (f"@{engine}" if engine else "") + (json.dumps(plugin, sort_keys=True) if plugin else "")
                + (json.dumps(mechanisms, sort_keys=True) if mechanisms else ""))

    @property
    def signature(self) -> str:
        """The arm plus the content hash of its statistics."""
        return f"{self.arm_signature}|stats={stats_identity(self.config)}"

    @property
    def plan_hash(self) -> str | None:
        return (self.meta.get("plan_hash") or self.config.get("plan_hash")
                or (self.confirm or {}).get("plan_hash"))


def _short_pair(a: str, b: str) -> tuple[str, str]:
    """Prefixes of two hashes long enough to show where they differ."""
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    n = max(10, same + 4)
    return a[:n], b[:n]


def _read_records(path: Path, rec_path: Path, config_hash) -> tuple[list, list]:
    """Records of one file; a record of another configuration is refused with its line number
    (as `run` does on resume); a half-written last line is dropped with a warning."""
    read = read_jsonl(rec_path, "record")
    for lineno, rec in read.rows:
        if isinstance(config_hash, str) and rec.get("config_hash") != config_hash:
            theirs, ours = _short_pair(str(rec.get("config_hash")), config_hash)
            raise ProtocolError(f"{rec_path}:{lineno}: record of another configuration ({theirs}, "
                                f"this run is {ours}); a report counts only a run's own records")
    warnings = [f"{rec_path}: dropped a half-written last line"] if read.partial_tail else []
    return read.objects, warnings


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
    digest = config_hash(meta["config"])
    if meta.get("config_hash") != digest:  # edited after the run: its records are not this configuration's
        raise ProtocolError(f"run {path.name}: config.json does not hash to its configuration hash "
                            f"({str(meta.get('config_hash'))[:12]}; its config hashes to {digest[:12]}): refused")
    records, warnings = [], [f"{path}: shard {s} has no records yet" for s in shards.missing_shards(path)]
    for rec_path in rec_paths:
        recs, w = _read_records(path, rec_path, meta.get("config_hash"))
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
        for rec in ungraded:
            text, gold = rec.get("text"), rec.get("gold")
            # No text (a failed generation) or no gold answer cannot be right: null = wrong.
            if text is None or gold is None:
                g = None
            elif grade is None:  # the default grader reads the finish reason: cut off = marked final only
                g = grading.grade(text, gold, finish_reason=rec.get("finish_reason"))
            else:
                g = grade(text, gold)
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
            read = read_jsonl(trace_path, "trace")
            trace += read.objects
            warnings += [f"{trace_path}: dropped a half-written last line"] if read.partial_tail else []
    return Run(path=path, meta=meta, config=meta["config"], records=records, confirm=confirm,
               trace=trace, warnings=warnings)


SIZING_NOTE = "sizing.json"  # written into a runs folder by `retention size --out`; stated by the report


def sizing_notes(paths) -> list[str]:
    """The report's lines for the runs folders among `paths` that hold a sizing note (a job that ran
    fewer problems than it asked for because this host was measured too slow for all of them)."""
    out = []
    for p in map(Path, paths):
        path = p / SIZING_NOTE
        if not path.is_file():
            continue
        try:
            note = json.loads(path.read_text())
            out.append(f"{note['model']}: this job was {note['line']} (retention size, {note['written']})")
        except (ValueError, KeyError, TypeError):
            out.append(f"{path}: an unreadable sizing note (the job's problem count was chosen by retention size)")
    return out


def find_run_dirs(paths) -> list[Path]:
    """Expand each path: a run directory itself, or a folder searched for run directories.
    A directory reached twice (given twice, or inside a folder also given) is listed once."""
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
    return list(dict.fromkeys(q.resolve() for q in out))


def refuse_duplicates(runs: list[Run]) -> None:
    """One run (configuration hash and split) reached under two paths is refused, naming both:
    counting it twice would double its comparisons and inflate m."""
    seen: dict = {}
    for run in runs:
        other = seen.setdefault(run.identity, run)
        if other is not run:
            raise ProtocolError(f"run {run.run_id} (split {run.split}) is given twice: {other.path} and "
                                f"{run.path} (a run and its merged copy, or shards of one run: merge them with "
                                "`retention merge`); give each run once")


def correct(rec: dict) -> int:
    """1 only for a verdict of True; failed, ungradable (null) or wrong generations are 0."""
    return 1 if rec.get("verdict") is True or rec.get("verdict") == 1 else 0


def pair_runs(treatment: Run, baseline: Run) -> stats.PairedData:
    """Pair two runs by (problem_id, sample) into per-problem sums; unpaired records are an error."""
    if treatment.split != baseline.split:
        raise ProtocolError(f"runs {treatment.run_id} and {baseline.run_id} are on different splits "
                            f"({treatment.split} vs {baseline.split}): they cannot be paired")
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


def assign_labels(runs: list[Run]) -> None:
    """Label = scorer + the declared parameters that differ between runs of that scorer (never a
    path, never the statistics: each model has its own). Only where two runs of one cell would
    still share label and accounting mode is a short statistics hash added, else the plan hash
    (runs of two plans), else a config hash."""
    by_scorer: dict = {}
    for run in runs:
        by_scorer.setdefault(run.scorer, []).append(declared_params(run.config))
    for run in runs:
        params = declared_params(run.config)
        siblings = by_scorer[run.scorer]
        varying = sorted(k for k in {k for p in siblings for k in p}
                         if len({json.dumps(p.get(k), sort_keys=True) for p in siblings}) > 1)
        run.label_parts = [f"{k}={params.get(k)}" for k in varying]
        _set_label(run)
    for group in _collisions(runs):
        hashes = [_content_hash(r.config) for r in group]
        if None not in hashes and len(set(hashes)) == len(group):
            for run, digest in zip(group, hashes):
                run.label_parts.append(f"stats={digest[:8]}")
                _set_label(run)
    for group in _collisions(runs):  # arms of two plans (a joint report of confirm directories)
        plans = [r.plan_hash for r in group]
        if None not in plans and len(set(plans)) == len(group):
            for run in group:
                run.label_parts.append(f"plan={run.plan_hash[:8]}")
                _set_label(run)
    for group in _collisions(runs):
        for run in group:
            run.label += f"#{str(run.meta.get('config_hash') or run.run_id)[:6]}"


def _content_hash(config: dict) -> str | None:
    """The statistics' sha256 when the run recorded one (an old run's path is never shown)."""
    if config.get("stats_sha256"):
        return str(config["stats_sha256"])
    value = str((config.get("scorer_params") or {}).get("stats") or "")
    return value[len("sha256:"):] if value.startswith("sha256:") else None


def _set_label(run: Run) -> None:
    run.label = f"{run.scorer}[{','.join(run.label_parts)}]" if run.label_parts else run.scorer
    for fam in ("cadence", "routing", "state", "decoding"):  # a non-default mechanism is part of the arm's name
        entry = run.config.get(fam)
        if entry is not None:
            run.label += f"+{entry.get('name') if isinstance(entry, dict) else entry}"
    if run.config.get("protect_prompt"):  # the report says which prompt rule ran
        run.label += "+pp"
    elif run.config.get("protect_prompt_counted"):  # kept inside b (random-pp's own rule)
        run.label += "+pp-in"
    elif run.config.get("protect_prompt_counted") is False and run.scorer == "random-pp":
        run.label += "+no-pp"  # the preset with its prompt evictable
    if run.config.get("engine"):
        run.label += f"@{run.config['engine']}"


def _collisions(runs: list[Run]) -> list[list[Run]]:
    seen: dict = {}
    for run in runs:
        seen.setdefault((run.cell, run.label, run.accounting), []).append(run)
    return [g for g in seen.values() if len(g) > 1]



# The two memory conventions an arm's prompt rule puts it in (docs/random-control.md).
PROTOCOL_CONVENTION = "prompt counted"
PEERS_CONVENTION = "prompt on top (peers')"


def prompt_rule(config: dict) -> str:
    """"evict", "keep" (counted inside b) or "keep-on-top" of a run configuration."""
    if config.get("protect_prompt"):
        return "keep-on-top"
    return "keep" if config.get("protect_prompt_counted") else "evict"


def prompt_convention(t_rule: str, b_rule: str) -> str:
    """How a comparison's two arms count the prompt: the protocol's meter (both count it: matched
    memory), the peers' (both keep it on top of b), or a mixed pair, said as such."""
    conv = {rule: PEERS_CONVENTION if rule == "keep-on-top" else PROTOCOL_CONVENTION for rule in (t_rule, b_rule)}
    if conv[t_rule] == conv[b_rule]:
        return conv[t_rule]
    return f"MIXED: treatment {conv[t_rule]}, baseline {conv[b_rule]} (memory not matched)"
