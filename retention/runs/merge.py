"""Merging shards into one run directory with the layout of an unsharded run.

`merge(paths, out)` gathers shard files (`protocol.shards`) from run directories, or from folders
holding run directories (several arms at once), groups them by configuration hash and checks, for
each run, before anything is written:

* every shard of the same configuration, cut into the same number of shards, each given once;
* the same code version, split manifest and `--trace` setting in every shard;
* exactly the pairs the shard rule gives each shard: none missing, none duplicated, none foreign,
  every record carrying the run's configuration hash;
* in a traced run (`--trace`), a trace line with its cache trace for every record.

Each violation is one `RetentionError` line. The merged `records.jsonl` lists the records in run
order (problem-major, then sample) so that it equals, record for record, the unsharded run's.
`consolidate(run_dir)` does the same in place, for shards that all wrote into one directory (a
shared file system); `open_shard_run` is how `retention run` opens a run directory for a shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from protocol import shards as layout
from protocol.report import find_run_dirs
from protocol.splits import manifest_sha256, run_problems
from retention.errors import RetentionError
from retention.runs.runner import code_version, open_run, run_id_for
from retention.runs.shard import RULE, Shard, shard_of, shard_pairs, write_sidecar


@dataclass
class Part:
    """One shard's files in one run directory."""

    run_dir: Path
    meta: dict  # the directory's config.json
    shard: Shard
    sidecar: dict

    @property
    def records_path(self) -> Path:
        return self.run_dir / self.shard.records_name

    @property
    def trace_path(self) -> Path:
        return self.run_dir / self.shard.trace_name

    @property
    def where(self) -> str:
        return f"shard {self.shard} in {self.run_dir}"

    @property
    def code_version(self):
        return self.sidecar.get("code_version", self.meta.get("code_version"))

    @property
    def trace(self) -> bool:
        """Whether the shard ran with --trace (absent in config.json: it did not)."""
        return bool(self.meta.get("trace", False))


@dataclass
class MergedRun:
    """A validated run: its meta, its records and traces in run order."""

    meta: dict
    parts: list[Part]
    records: list[bytes] = field(default_factory=list)  # raw lines, byte for byte as the shards wrote them
    traces: list[bytes] = field(default_factory=list)

    @property
    def run_id(self) -> str:
        return str(self.meta["run_id"])


# --------------------------------------------------------------------------------------------------
# reading


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RetentionError(f"{path}: unreadable ({exc})") from None
    if not isinstance(obj, dict):
        raise RetentionError(f"{path}: not a JSON object")
    return obj


def _jsonl_lines(path: Path) -> list[tuple[bytes, dict]]:
    """(raw line, object) of each complete line; a half-written last line (a killed writer) is
    ignored, as resume does; any other unreadable line is refused with its number."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    out = []
    lines = data.split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            if i == len(lines) - 1:
                continue
            raise RetentionError(f"{path}:{i + 1}: unreadable line") from None
        if i == len(lines) - 1:
            continue  # complete JSON but no newline: the writer died before finishing the line
        if not isinstance(obj, dict) or "problem_id" not in obj or "sample" not in obj:
            raise RetentionError(f"{path}:{i + 1}: not a record with problem_id and sample")
        out.append((raw, obj))
    return out


def find_parts(paths) -> list[Part]:
    """The shards in `paths`: run directories, or folders searched for run directories."""
    parts = []
    for d in find_run_dirs(paths):
        shard_files = layout.shard_record_files(d)
        if not shard_files:
            what = "an unsharded or merged run (records.jsonl)" if (d / layout.RECORDS).is_file() else "no records"
            raise RetentionError(f"{d} holds {what}, not shards")
        meta = _read_json(d / "config.json")
        for (i, n), _path in shard_files.items():
            shard = Shard(i, n)
            side = d / shard.sidecar_name
            parts.append(Part(d, meta, shard, _read_json(side) if side.is_file() else {}))
    return parts


# --------------------------------------------------------------------------------------------------
# validation


def _differing_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _expected_pairs(config: dict) -> list[tuple[str, int]]:
    """Every (problem_id, sample) of a run, in run order (pair j is the j-th), from its configuration."""
    problems = run_problems(config["split"], config.get("dataset", "math500"), config.get("data"))
    if config.get("limit"):
        problems = problems[: int(config["limit"])]
    samples = int(config["samples"])
    return [(problems[p].unique_id, s) for p, s in shard_pairs(len(problems), samples, None)]


def plan_merge(parts: list[Part]) -> list[MergedRun]:
    """Check the parts as described in the module docstring; one MergedRun per configuration."""
    if not parts:
        raise RetentionError("no shards to merge")
    groups: dict[str, list[Part]] = {}
    for part in parts:
        groups.setdefault(str(part.meta.get("config_hash")), []).append(part)
    runs = []
    for h, group in groups.items():
        counts = sorted({p.shard.count for p in group})
        if len(counts) > 1:
            raise RetentionError(f"run {group[0].meta.get('run_id')}: shards cut into different counts {counts}")
        n = counts[0]
        by_index: dict[int, Part] = {}
        for p in group:
            if p.shard.index in by_index:
                raise RetentionError(f"shard {p.shard} of run {p.meta.get('run_id')} given twice: "
                                     f"{by_index[p.shard.index].run_dir} and {p.run_dir}")
            by_index[p.shard.index] = p
        missing = [i for i in range(n) if i not in by_index]
        if missing:
            _explain_missing(h, group, groups, missing, n)
        ordered = [by_index[i] for i in range(n)]
        for key, what in (("code_version", "code version"), ("split_manifest_sha256", "split manifest"),
                          ("trace", "--trace setting")):
            values = {p.where: (getattr(p, key) if key != "split_manifest_sha256" else p.sidecar.get(key))
                      for p in ordered}
            if len(set(values.values())) > 1:
                (wa, va), (wb, vb) = _two_different(values)
                raise RetentionError(f"shards ran with different {what}s: {wa} has {va}, {wb} has {vb}")
        runs.append(_collect(ordered))
    return runs


def _two_different(values: dict) -> tuple[tuple, tuple]:
    items = list(values.items())
    first = items[0]
    return first, next(it for it in items if it[1] != first[1])


def _explain_missing(h, group, groups, missing, n) -> None:
    """A run lacks shards: say whether they were given under another configuration."""
    cfg = group[0].meta.get("config", {})
    for other_h, other in groups.items():
        if other_h != h and any(p.shard.count == n and p.shard.index in missing for p in other):
            o = other[0]
            keys = _differing_keys(cfg, o.meta.get("config", {}))
            raise RetentionError(f"configuration mismatch: {group[0].where} and {o.where} differ in {keys}")
    shown = ", ".join(f"{i}/{n}" for i in missing)
    raise RetentionError(f"run {group[0].meta.get('run_id')}: missing shard(s) {shown}")


def _collect(ordered: list[Part]) -> MergedRun:
    meta = ordered[0].meta
    h = meta.get("config_hash")
    n = len(ordered)
    expected = _expected_pairs(meta["config"])
    owner = {pair: shard_of(j, n) for j, pair in enumerate(expected)}
    lines: dict[tuple, bytes] = {}
    seen_in: dict[tuple, Part] = {}
    for part in ordered:
        for raw, rec in _jsonl_lines(part.records_path):
            key = (str(rec["problem_id"]), int(rec["sample"]))
            if rec.get("config_hash") != h:
                raise RetentionError(f"{part.where}: record {key} has configuration hash "
                                     f"{str(rec.get('config_hash'))[:12]}, the run's is {str(h)[:12]}")
            if key not in owner:
                raise RetentionError(f"{part.where}: pair {key} is not in the run's problems")
            if owner[key] != part.shard.index:
                raise RetentionError(f"{part.where}: pair {key} belongs to shard {owner[key]}/{part.shard.count} "
                                     "under the shard rule")
            if key in seen_in:
                raise RetentionError(f"duplicated pair {key} in {part.where}")
            seen_in[key] = part
            lines[key] = raw
    absent = [k for k in expected if k not in lines]
    if absent:
        where = ordered[owner[absent[0]]].where
        raise RetentionError(f"{len(absent)} pair(s) missing, e.g. {absent[0]} of {where} "
                             "(resume that shard first)")
    traces: dict[tuple, bytes] = {}
    for part in ordered:
        for raw, tr in _jsonl_lines(part.trace_path):
            traces[(str(tr["problem_id"]), int(tr["sample"]))] = raw  # a retried write: the last one wins
            if ordered[0].trace and "cache" not in tr:
                raise RetentionError(f"{part.where}: the trace line of {(tr['problem_id'], tr['sample'])} has no "
                                     "cache trace in a run with --trace")
    if ordered[0].trace:
        untraced = [k for k in expected if k not in traces]
        if untraced:
            raise RetentionError(f"{len(untraced)} record(s) of a run with --trace have no trace line, e.g. "
                                 f"{untraced[0]} of {ordered[owner[untraced[0]]].where}")
    merged = dict(meta)
    merged["merged"] = {
        "rule": RULE, "shards": len(ordered), "code_version": ordered[0].code_version,
        "split_manifest_sha256": ordered[0].sidecar.get("split_manifest_sha256"),
        "from": [{"shard": str(p.shard), "dir": str(p.run_dir), "host": p.sidecar.get("host"),
                  "records_sha256": hashlib.sha256(p.records_path.read_bytes()).hexdigest()} for p in ordered],
    }
    return MergedRun(merged, ordered, [lines[k] for k in expected], [traces[k] for k in expected if k in traces])


# --------------------------------------------------------------------------------------------------
# writing


def _write_run(run: MergedRun, target: Path) -> None:
    """Write config.json, records.jsonl and trace.jsonl into a new folder beside `target`, then
    rename it into place: an interrupted merge leaves no half-merged run directory."""
    tmp = target.parent / f".{target.name}.merging-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(run.meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (tmp / layout.TRACE).write_bytes(b"".join(t + b"\n" for t in run.traces))
    (tmp / layout.RECORDS).write_bytes(b"".join(r + b"\n" for r in run.records))
    tmp.rename(target)


def merge(paths, out: Path) -> list[Path]:
    """Merge the shards found under `paths` into `out/<run id>/`, one directory per run."""
    out = Path(out)
    runs = plan_merge(find_parts(paths))
    targets = [out / r.run_id for r in runs]
    taken = [t for t in targets if t.exists()]
    if taken:
        raise RetentionError(f"{taken[0]} already exists; merge into another --out")
    inputs = {p.run_dir for r in runs for p in r.parts}
    if any(t.resolve() in inputs for t in targets):
        raise RetentionError("--out would overwrite a shard directory; choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    for run, target in zip(runs, targets):
        _write_run(run, target)
    return targets


def consolidate(run_dir: Path) -> bool:
    """Merge the shards of one run directory in place (records.jsonl, trace.jsonl, config.json's
    `merged` entry) and move the shard files into `shards/`. Returns False when there was nothing
    to do; raises with one line when the shards are incomplete or inconsistent."""
    run_dir = Path(run_dir)
    shard_files = layout.shard_record_files(run_dir)
    if not shard_files:
        return False
    if (run_dir / layout.RECORDS).is_file():
        meta = _read_json(run_dir / "config.json")
        if "merged" not in meta:
            raise RetentionError(f"{run_dir} holds both records.jsonl and shard records; keep one of them")
        _move_shard_files(run_dir)  # an earlier consolidation stopped before this step
        return True
    run = plan_merge(find_parts([run_dir]))[0]
    tmp_cfg = run_dir / "config.json.tmp"
    tmp_cfg.write_text(json.dumps(run.meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name, lines in ((layout.TRACE, run.traces), (layout.RECORDS, run.records)):
        tmp = run_dir / f"{name}.tmp"
        tmp.write_bytes(b"".join(x + b"\n" for x in lines))
        if name == layout.RECORDS:
            tmp_cfg.replace(run_dir / "config.json")
        tmp.replace(run_dir / name)
    _move_shard_files(run_dir)
    return True


def _move_shard_files(run_dir: Path) -> None:
    dest = run_dir / "shards"
    dest.mkdir(exist_ok=True)
    for (i, n) in layout.shard_record_files(run_dir):
        for name in (layout.records_name(i, n), layout.trace_name(i, n), layout.sidecar_name(i, n)):
            if (run_dir / name).exists():
                (run_dir / name).replace(dest / name)


def open_shard_run(out: Path, config: dict, shard: Shard | None, trace: bool = False):
    """The run directory a `retention run` process writes to.

    Unsharded: shards already in the directory are first consolidated (so their records count as
    done); incomplete shards are refused. Sharded: refused when the directory already holds a
    merged or unsharded `records.jsonl`; the shard's sidecar is (re)written. trace: `--trace` (the
    directory's setting, `RunDir.trace`).
    """
    run_dir = Path(out) / run_id_for(config)
    if shard is None:
        if layout.shard_record_files(run_dir):
            try:
                consolidate(run_dir)
            except RetentionError as exc:
                raise RetentionError(f"{run_dir} holds shards that cannot be merged yet ({exc}); "
                                     "finish them with --shard I/N") from None
        return open_run(out, config, trace=trace)
    if (run_dir / layout.RECORDS).is_file():
        raise RetentionError(f"{run_dir} already holds an unsharded or merged run (records.jsonl); "
                             "write shards to another --out")
    run = open_run(out, config, shard, trace=trace)
    write_sidecar(run.path, shard, code_version(), _manifest_sha256())
    (run.path / shard.records_name).touch()  # a shard that owns no pair still shows it ran
    return run


def _manifest_sha256() -> str | None:
    try:
        return manifest_sha256(splits_dir=None)
    except Exception:  # noqa: BLE001 - no committed splits beside the package: nothing to record
        return None
