"""Runs: a resolved configuration, a run directory, resumable append-only records.

A run directory (`<out>/<run-id>/`) holds `config.json`, `records.jsonl` (one line per (problem,
sample), flushed as each finishes) and `trace.jsonl` (per-record cache trace; with `--trace` each
line also holds what the cache held, `retention.runtime.trace`). The run id ends with
the configuration hash, so rerunning the same command finds the same directory and resumes:
finished records are skipped, a half-written last line is discarded, nothing is duplicated.

Several arms (e.g. `alpha` vs `triattention`) run over the same problems with the same seed per
(problem, sample), one after the other; a comparison interrupted between them resumes where it stopped.

(Over 400 lines: the run directory, its record store and the loop that fills them share one
write-order and resume invariant, kept in one place.)
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from protocol import grading
from protocol.io import (append_line, ensure_dir, jsonl_line, load_json_object, read_jsonl,
                         write_atomic, write_json)
from protocol.shards import record_files
from retention import __version__
from retention.errors import RetentionError
from retention.models import format_prompt, output_text
from retention.plugins import differing_keys, loaded_outside_since, refuse_other_code, stable_identity
from retention.runs.settings import RunSettings
from retention.runs.shard import shard_pairs, shard_size
from retention.runs.slots import auto_batch_size, resolve_slots
from retention.runs.spec import ArmSpec, config_hash
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.guard import GuardRefusal
from retention.runtime.sampling import LEGACY_SAMPLER
from retention.runtime.trace import CacheTracer
from retention.host import host_fingerprint
from retention.versions import library_versions

# Bumped when the meaning of a configuration field changes; plans and ledgers record it.
CONFIG_SCHEMA_VERSION = 1


def derive_seed(base_seed: int, problem_id: str, sample: int) -> int:
    """The sampling seed of one (problem, sample): the same in every arm of a comparison."""
    h = hashlib.sha256(f"{base_seed}:{problem_id}:{sample}".encode()).hexdigest()
    return int(h[:8], 16) & 0x7FFFFFFF


def code_version() -> str:
    """`git describe` of the source tree when available, else the package version."""
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True, text=True, timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            described = out.stdout.strip()
            untracked = subprocess.run(["git", "-C", str(here.parent), "ls-files", "--others", "--exclude-standard",
                                        "--", "retention", "protocol"], capture_output=True, text=True, timeout=5)
            if untracked.stdout.strip() and not described.endswith("-dirty"):
                described += "-dirty"  # an untracked module under the package folders runs too
            return f"{__version__}+g{described}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def run_id_for(config: dict) -> str:
    """`<model>-<scorer>-<budget>-<hash>`. The hash covers the configuration except what changes with
    a plugin's code (its version and source sha256s): a changed plugin then finds the run directory of
    the old code and is refused there, naming what changed, instead of silently starting a new run."""
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(config["model"])).name) or "model"
    scorer = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(config["scorer"]).rpartition("/")[2]) or "scorer"
    budget = "full" if config.get("budget") is None else f"b{config['budget']}"
    keyed = config
    if isinstance(config.get("scorer_plugin"), dict):
        keyed = dict(config, scorer_plugin=stable_identity(config["scorer_plugin"]))
    return f"{model}-{scorer}-{budget}-{config_hash(keyed)[:10]}"


def _short_pair(a: str, b: str) -> tuple[str, str]:
    """Two hashes shortened to 10 characters, or as many as it takes for them to differ."""
    n = 10
    while n < max(len(a), len(b)) and a[:n] == b[:n]:
        n += 6
    return a[:n], b[:n]


def _key(row: dict, where: str) -> tuple[str, int]:
    pid, sample = row.get("problem_id"), row.get("sample")
    if not isinstance(pid, str) or not isinstance(sample, int) or isinstance(sample, bool):
        raise RetentionError(f"{where}: needs a string problem_id and an integer sample")
    return pid, sample


def _repair_tail(path: Path, read) -> None:
    """Cut a half-written last line (a writer killed mid-line) so the next append starts clean."""
    if read.partial_tail:
        with open(path, "r+b") as f:
            f.truncate(read.valid_end)


class RecordStore:
    """Append-only `records.jsonl` with crash-safe resume.

    Resume keeps every valid line, cuts a half-written last line, and refuses (with the line
    number) a corrupt earlier line, a duplicated (problem, sample) and a record of another
    configuration: silently dropping or mixing records would bias what a report computes.
    """

    def __init__(self, path: Path, config_hash: str | None = None):
        self.path = path
        self.config_hash = config_hash
        self.done: dict[tuple[str, int], dict] = {}
        self._repair_and_load()

    def _repair_and_load(self) -> None:
        if not self.path.exists():
            return
        read = read_jsonl(self.path, "record")
        for lineno, rec in read.rows:
            where = f"{self.path}:{lineno}"
            key = _key(rec, where)
            if self.config_hash is not None and rec.get("config_hash") != self.config_hash:
                theirs, ours = _short_pair(str(rec.get("config_hash")), self.config_hash)
                raise RetentionError(f"{where}: record of another configuration (config_hash {theirs}, "
                                     f"this run is {ours})")
            if key in self.done:
                raise RetentionError(f"{where}: duplicated record {key}")
            self.done[key] = rec
        _repair_tail(self.path, read)

    def has(self, problem_id: str, sample: int) -> bool:
        return (problem_id, sample) in self.done

    def append(self, record: dict) -> None:
        append_line(self.path, jsonl_line(record))
        self.done[(record["problem_id"], record["sample"])] = record


@dataclass
class RunDir:
    """One arm's run directory, held under an exclusive lock while this object lives.

    Write order per (problem, sample): the trace line, then the record. A kill between the two
    leaves a trace line without its record; opening the directory drops such lines (and any
    duplicate), so after a resume each record has exactly one trace line.
    """

    path: Path
    config: dict
    # A shard of a run writes its own files (retention.runs.shard): records.shard-I-of-N.jsonl, ...
    records_name: str = "records.jsonl"
    trace_name: str = "trace.jsonl"
    # --trace: every record's trace line holds its cache trace. Not in the configuration (nor its
    # hash): config.json notes it beside it, and a directory's records are all traced or none.
    trace: bool = False
    records: RecordStore = field(init=False)

    def __post_init__(self):
        if not (self.path / "config.json").exists():
            refuse_other_code(self.path, self.config)  # before anything is created
        ensure_dir(self.path, "run directory")
        # One writer per records file: shards of a run share the directory, not their files.
        lock = ".lock" if self.records_name == "records.jsonl" else f".{self.records_name}.lock"
        self._lock = _hold_lock(self.path, lock)
        try:
            self._open()
        except BaseException:  # a refused directory is left unlocked (an in-process caller may retry)
            self.close()
            raise

    def _open(self) -> None:
        """Check or write config.json, load the records, repair the trace file (under the lock)."""
        cfg_file = self.path / "config.json"
        h = config_hash(self.config)
        if cfg_file.exists():
            existing = load_json_object(cfg_file, "run configuration")
            if existing.get("config_hash") != h:
                old = existing.get("config")
                keys = differing_keys(old, self.config) if isinstance(old, dict) else []
                what = f" ({', '.join(keys)} differ)" if keys else ""
                raise RetentionError(f"{cfg_file} belongs to another configuration{what}; choose another --out")
            self._settle_trace(cfg_file, existing)
        else:
            meta = {
                "run_id": self.path.name,
                "config_hash": h,
                "config_schema": CONFIG_SCHEMA_VERSION,
                "config": self.config,
                "versions": library_versions(),
                "host": host_fingerprint(),
                "code_version": code_version(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "trace": self.trace,
            }
            write_json(cfg_file, meta)
        self.records = RecordStore(self.path / self.records_name, h)
        self._repair_trace()

    def _settle_trace(self, cfg_file: Path, meta: dict) -> None:
        """Resume only with the directory's own --trace setting (absent: untraced, as every run before
        traces); a directory that holds no record yet takes the new one."""
        was = bool(meta.get("trace", False))
        if was == self.trace:
            return
        if any(p.stat().st_size for p in record_files(self.path)):
            flag = "with" if was else "without"
            raise RetentionError(f"{self.path} was written {flag} --trace; resume it {flag} --trace (a run's records "
                                 "are all traced or none), or choose another --out")
        write_json(cfg_file, dict(meta, trace=self.trace))

    def _repair_trace(self) -> None:
        path = self.path / self.trace_name
        if not path.exists():
            return
        read = read_jsonl(path, "trace")
        keep, seen = [], set()
        for lineno, row in read.rows:
            key = _key(row, f"{path}:{lineno}")
            if key in self.records.done and key not in seen:
                seen.add(key)
                keep.append(row)
        if len(keep) != len(read.rows):
            write_atomic(path, b"".join(jsonl_line(r) for r in keep))
        else:
            _repair_tail(path, read)

    def close(self) -> None:
        """Release the directory's lock (also released when the process ends, however it ends)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    @property
    def hash(self) -> str:
        return config_hash(self.config)

    def missing(self, problems, samples: int):
        """(problem, sample index) pairs without a record, generated lazily in problem order."""
        return ((p, s) for p in problems for s in range(samples) if not self.records.has(p.unique_id, s))

    def append_trace(self, problem_id: str, sample: int, steps: list[int], tokens: list[float],
                     cache: dict | None = None) -> None:
        """One record's trace line: the meter's downsampled per-step cache length and, in a traced
        run, what the cache held (`cache`, `CacheTrace.to_json()`)."""
        line = {"problem_id": problem_id, "sample": sample, "steps": steps, "tokens": tokens}
        if cache is not None:
            line["cache"] = cache
        append_line(self.path / self.trace_name, jsonl_line(line))


def _hold_lock(run_dir: Path, name: str = ".lock"):
    """An open file holding an exclusive flock on `<run dir>/<name>` (non-blocking)."""
    fh = open(run_dir / name, "a")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise RetentionError(f"another run is writing {run_dir}; wait for it to finish (one writer per "
                             "run directory)") from None
    return fh


def count_pending(arms: list["Arm"], problems, samples: int, shard=None) -> tuple[int, int]:
    """(total, missing) generations of all pairs or of one shard's; counted without materialising
    the pairs (each arm's store holds only its own shard's records)."""
    total = shard_size(len(problems) * samples, shard) * len(arms)
    ids = {p.unique_id for p in problems}
    done = sum(1 for a in arms for pid, s in a.run.records.done if pid in ids and s < samples)
    return total, total - done


def open_run(out: Path, config: dict, shard=None, trace: bool = False) -> RunDir:
    """The run directory of `config` under `out`; a `retention.runs.shard.Shard` writes its own files."""
    if shard is None:
        return RunDir(Path(out) / run_id_for(config), config, trace=trace)
    return RunDir(Path(out) / run_id_for(config), config, shard.records_name, shard.trace_name, trace=trace)


@dataclass
class Arm:
    """One arm of a run: where its records go and what it is (`ArmSpec`: its five mechanisms)."""

    run: RunDir
    spec: ArmSpec


def make_record(*, config_hash: str, problem_id: str, sample: int, seed: int, prompt_tokens: int,
                token_ids: list[int], text: str, finish_reason: str, meter, cadence, wall_seconds: float,
                batch_size: int, gold, grader=None, fidelity=None, problem: str | None = None,
                trace=None, slots: int | None = None) -> dict:
    """One record of the schema in docs/records.md; every engine writes its records through this.
    trace: the sequence's `CacheTrace` in a traced run (its prompt summary joins the record)."""
    record = {
        "config_hash": config_hash,
        "problem_id": problem_id,
        "sample": sample,
        "seed": seed,
        "prompt_tokens": prompt_tokens,
        "output_token_ids": list(token_ids),
        "output_tokens": len(token_ids),
        "text": text,
        "finish_reason": finish_reason,
        **meter.summary(),
        "budget": cadence.budget,
        "accounting": cadence.accounting,
        "wall_seconds": wall_seconds,
        "tokens_per_second": len(token_ids) / wall_seconds if wall_seconds > 0 else 0.0,
        "batch_size": batch_size,
        "gold": gold,
        "host": host_fingerprint(),  # tokens may depend on the CPU's instruction set (docs/reproducibility.md)
    }
    if slots is not None:  # this project's engine: the static step's slot count (retention.runs.slots)
        record["slots"] = slots
    if fidelity is not None:
        record["fidelity"] = fidelity.summary()
    if trace is not None:
        record.update(prompt_evicted_step=trace.prompt_evicted_step, prompt_held_final=trace.prompt_held_final)
    if grader is not None and gold is not None:
        # the problem text lists a multiple-choice problem's options and the expressions an answer
        # must not merely restate; a cut-off output ("length") is graded on a marked final only
        gr = grader(text, gold, problem=problem, finish_reason=finish_reason)
        record.update(extracted=gr.extracted, verdict=gr.verdict, reason=gr.reason, rule=gr.rule,
                      grader_version=grading.GRADER_VERSION)
        if gr.restated:
            record["restated"] = True
    else:
        record.update(extracted=None, verdict=None, reason=None, rule=None)
    return record


def _record(arm: Arm, p, s: int, seed: int, prompt: list[int], g, tok, grader, slots: int) -> dict:
    return make_record(config_hash=arm.run.hash, problem_id=p.unique_id, sample=s, seed=seed,
                       prompt_tokens=len(prompt), token_ids=g.token_ids,
                       text=output_text(tok, prompt, g.token_ids), finish_reason=g.finish_reason,
                       meter=g.meter, cadence=arm.spec.cadence, wall_seconds=g.wall_seconds, batch_size=slots,
                       gold=getattr(p, "answer", None), grader=grader, fidelity=g.fidelity,
                       problem=getattr(p, "problem", None), trace=g.trace, slots=slots)


def run_prompts(loaded, problems) -> dict[str, list[int]]:
    """The prompt token ids of every problem of a run, by problem id (the longest sizes the rows)."""
    style = getattr(loaded, "prompt", "chat")
    return {p.unique_id: format_prompt(loaded.tokenizer, p.problem, style) for p in problems}


def run_arms(loaded, arms: list[Arm], problems, settings: RunSettings, *, shard=None) -> None:
    """Generate every missing (problem, sample) record of every arm, `batch_size` sequences at a time.

    Each arm decodes the same pairs with the same seed per (problem, sample), one arm after the
    other; an arm's slots refill from all of its pending pairs, so it ends in one tail (its last
    answers decoding beside padding rows), not one per chunk. Each record is written as soon as its
    sequence ends, so a killed run loses only the sequences in flight, and a rerun resumes each arm.
    loaded: a `retention.models.LoadedModel`; problems: objects with `unique_id`, `problem`,
    `answer`; settings: the run's `RunSettings`, of which this reads the samples per problem, the
    sampling (each arm draws with its own configuration's sampler), fidelity and the output: the
    slot count (`batch_size`: `retention.runs.slots`, recorded in the run directory and matched on
    resume; None chooses one for the device's memory and says so), grading, progress and trace (what
    each sequence's cache held, `retention.runtime.trace.CacheTracer`, into its trace line). shard: a
    `retention.runs.shard.Shard` to generate only its pairs (None: all of them).
    """
    samples, trace = settings.problems.samples, settings.output.trace
    mixed = [a.run.path for a in arms if a.run.trace != trace]
    if mixed:  # a traced directory takes only traced records, and the other way round
        raise RetentionError(f"{mixed[0]} is opened with trace={not trace}, the run with trace={trace}")
    eos = _eos_ids(loaded)
    kib = loaded.geometry.kib_per_token
    prompts = run_prompts(loaded, problems)  # all of them, in every shard: the longest sizes the rows
    longest = max(map(len, prompts.values()), default=0)
    slots = _arm_slots(loaded, arms, len(problems) * samples, settings, longest)
    total, missing = count_pending(arms, problems, samples, shard)
    bar = tqdm(total=total, initial=total - missing, disable=not settings.output.progress, unit="seq",
               dynamic_ncols=True)
    for arm, S in zip(arms, slots):
        _run_arm(loaded, arm, S, problems, prompts, settings, eos=eos, kib=kib, longest=longest, shard=shard, bar=bar)
    bar.close()


def _arm_slots(loaded, arms: list[Arm], pairs: int, settings: RunSettings, longest: int) -> list[int]:
    """Each arm's slot count (`retention.runs.slots.resolve_slots`) from the run's `batch_size`, or, when
    that is None, from one chosen for the device's memory by the arms' cadences, the generation limit
    and the `longest` prompt (`auto_batch_size`; its reason is said on stderr). pairs: the
    (problem, sample) pairs of the whole run."""
    batch_size = settings.output.batch_size
    explicit = batch_size is not None
    if batch_size is None:
        choice = auto_batch_size(loaded, [a.spec.cadence for a in arms], settings.sampling.max_new_tokens, longest,
                                 settings.fidelity, pairs)
        print(choice.why, file=sys.stderr)
        batch_size = choice.slots
    return resolve_slots(arms, batch_size, pairs, explicit)


def _run_arm(loaded, arm: Arm, S: int, problems, prompts, settings: RunSettings, *, eos, kib, longest, shard,
             bar) -> None:
    """Decode `arm`'s missing (problem, sample) pairs of `shard` on `S` slots, writing each record and its
    trace line as its sequence ends and advancing `bar`; nothing when the arm is complete. A plugin's
    exception while decoding, or a module it imports then, is refused in one line naming it (the records
    already written are kept). prompts: token ids by problem id; eos, kib: the model's end-of-sequence ids
    and KiB per cached token; longest: the longest prompt of the run (it sizes the rows)."""
    samples, out = settings.problems.samples, settings.output
    tok = loaded.tokenizer
    grader = grading.grade if out.grade else None
    # The sampler is the arm configuration's (absent: the legacy one), whatever the caller passed.
    cfg = SamplingConfig(**settings.sampling.engine_args(),
                         sampler=arm.spec.config.get("sampler", LEGACY_SAMPLER))
    # Pairs are drawn lazily as slots free: nothing is allocated per sample.
    pending = ((problems[i], s) for i, s in shard_pairs(len(problems), samples, shard)
               if not arm.run.records.has(problems[i].unique_id, s))
    first = next(pending, None)
    if first is None:  # this arm is complete
        return
    reqs = (Request((p, s), prompts[p.unique_id], derive_seed(settings.sampling.seed, p.unique_id, s))
            for p, s in itertools.chain([first], pending))

    def on_finish(req, g):
        p, s = req.key
        record = _record(arm, p, s, req.seed, req.prompt_ids, g, tok, grader, S)
        steps, tokens = g.meter.trace()
        cache = None if g.trace is None else g.trace.to_json()
        arm.run.append_trace(p.unique_id, s, steps, tokens, cache)
        arm.run.records.append(record)
        bar.update(1)

    def on_step(st):
        if st.steps % 8 == 0:
            bar.set_postfix_str(f"{arm.spec.name} {st.tokens_per_second:.1f} tok/s, {st.busy} slots busy",
                                refresh=False)
            bar.refresh()

    policy = arm.spec.policy()
    if out.trace:
        policy.tracer = CacheTracer()
    policy.prepare(tok)
    modules_before = set(sys.modules)
    try:
        run_engine(loaded.model, reqs, policy, cfg, eos, kib, batch_size=S, fidelity=settings.fidelity,
                   max_prompt=longest, on_finish=on_finish, on_step=on_step if out.progress else None)
    except GuardRefusal:  # a plugin's broken output: its own line names it (`retention.policy.guard`)
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's failure is the user's input, not our bug
        plugins = arm.spec.plugins()
        if not plugins:
            raise
        named = " or ".join(f"{p.partition(':')[0]} plugin {p.partition(':')[2]!r}" for p in plugins)
        raise RetentionError(f"{named} raised during decoding ({type(exc).__name__}: "
                             f"{exc}); the {len(arm.run.records.done)} record(s) written are kept, rerun "
                             "to resume") from exc
    late = loaded_outside_since(modules_before) if arm.spec.plugins() else []
    if late:  # code that decided these records but is in no identity: said, not silently mixed
        raise RetentionError(f"{', '.join(arm.spec.plugins())} imported {late[0]}"
                             f"{f' and {len(late) - 1} more' if len(late) > 1 else ''} while decoding: not part "
                             "of its identity; import it at the plugin's module level and rerun in a new --out")


def _eos_ids(loaded) -> set[int]:
    ids = set()
    generation_config = getattr(loaded.model, "generation_config", None)  # a reference layout model has none
    for src in (loaded.tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids
