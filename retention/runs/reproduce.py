"""Re-run records of a run directory from its recorded configuration and compare them.

`retention reproduce RUN_DIR` is the evidence behind a claim that a run is reproducible: the
configuration in `config.json` is rebuilt through `validate_arm` (the same path `run` takes) and must
hash to the recorded `config_hash`, the model must load with the recorded revision (weights digest or
hub commit), and each chosen record is decoded again with its own seed at the slot count
(`slots`; older records: `batch_size`) it was decoded at, in rows sized by the run's longest prompt
as the run's were (`retention.runtime.engine`: the static step), so that a bfloat16 record is
reproduced token for token whichever records are chosen. Nothing is written into the run directory.

Tokens are not all that is compared: each reproduced text is graded again (its problem and finish
reason read as `run` reads them) and the record's `finish_reason`, `extracted` answer and `verdict`
and its meter fields (`METER_FIELDS`) must equal the reproduced ones; a record whose verdict was
edited is caught even where its tokens are intact. Records carry the host they were made on
(`retention.host`): on a host whose instruction sets or kernel libraries differ, the tokens of a
bfloat16 (or an unpinned float32) run cannot be expected to match, so the check says so and
compares at the level that can match (`Reproduction.level`: "answers", the finish reason,
extracted answer and verdict), the token and meter differences still listed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from protocol import grading
from protocol.io import load_json_object, read_jsonl
from retention.errors import RetentionError
from retention.host import PORTABLE_ENV, host_differences, host_fingerprint
from retention.models import load_model
from retention.models.prompts import output_text
from retention.models.arch.deepseek import on_reference_mla
from retention.plugins import differing_keys
from retention.runs.arms import validate_arm
from retention.runs.runner import _eos_ids, code_version, config_hash, derive_seed, run_prompts
from retention.runs.settings import RunSettings
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.scoring.calibration import default_stats_path

# Keys `execute` adds to a configuration after validation (from the loaded model).
_LOADED_KEYS = ("model_id", "model_revision", "prompt", "model_quant")
#: Record fields a reproduction must give again besides the tokens: the grade a report counts ...
ANSWER_FIELDS = ("finish_reason", "extracted", "verdict")
#: ... and the meter it averages.
METER_FIELDS = ("cache_mean_tokens", "cache_peak_tokens", "cache_final_tokens", "cache_mean_kib",
                "compactions", "decode_steps", "budget_exceeded")


def token_digest(token_ids: list[int]) -> str:
    """sha256 of a token sequence written as comma-separated decimal ids (16 hex digits shown)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token sequences differ (a prefix differs at the shorter length),
    or None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class FieldDifference:
    """One record field whose reproduced value is not the recorded one."""

    name: str
    recorded: object
    reproduced: object

    def text(self) -> str:
        return f"{self.name} recorded {self.recorded!r}, reproduced {self.reproduced!r}"


@dataclass(frozen=True)
class RecordCheck:
    """One record decoded again: the recorded and the reproduced token sequences, compared, and the
    answer and meter fields that differ (`fields`)."""

    problem_id: str
    sample: int
    recorded: tuple[int, ...]
    reproduced: tuple[int, ...]
    fields: tuple[FieldDifference, ...] = ()

    @property
    def difference(self) -> int | None:
        return first_difference(list(self.recorded), list(self.reproduced))

    def differing(self, names: tuple[str, ...]) -> list[FieldDifference]:
        return [f for f in self.fields if f.name in names]

    def line(self) -> str:
        """`<problem> sample <s>: identical ...` or `... differs at token i ...`, with both digests,
        then every differing field by name."""
        rec, rep = token_digest(list(self.recorded))[:16], token_digest(list(self.reproduced))[:16]
        head = f"{self.problem_id} sample {self.sample}:"
        i = self.difference
        fields = "".join(f"; {f.text()}" for f in self.fields)
        if i is None:
            word = "identical" if not self.fields else "same tokens"
            return f"{head} {word} ({len(self.recorded)} tokens, sha256 {rec}){fields}"

        def at(seq):
            return str(seq[i]) if i < len(seq) else "end"
        return (f"{head} differs at token {i}: recorded {at(self.recorded)}, reproduced {at(self.reproduced)} "
                f"(recorded {len(self.recorded)} tokens sha256 {rec}, reproduced {len(self.reproduced)} "
                f"tokens sha256 {rep}){fields}")


@dataclass(frozen=True)
class Reproduction:
    """What `reproduce` found: the provenance of both runs, one check per record, and the `level`
    compared: "tokens" (tokens, answers and meters must match) or "answers" (another host whose
    kernels differ: finish reason, extracted answer and verdict must match)."""

    run_dir: Path
    config_hash: str
    model_revision: str
    recorded_code: str
    current_code: str
    checks: tuple[RecordCheck, ...]
    host_differs: tuple[str, ...] = ()
    level: str = "tokens"
    recorded_grader: str | None = None  # the grader version the records note (None: not noted)

    @property
    def identical(self) -> bool:
        if self.level == "answers":
            return all(not c.differing(ANSWER_FIELDS) for c in self.checks)
        return all(c.difference is None and not c.fields for c in self.checks)

    def header(self) -> list[str]:
        same = "same" if self.recorded_code == self.current_code else "DIFFERENT"
        lines = [f"run {self.run_dir.name}: config_hash {self.config_hash[:12]} rebuilt from config.json",
                 f"model revision {self.model_revision}",
                 f"code: recorded {self.recorded_code}, now {self.current_code} ({same})"]
        if self.recorded_grader != grading.GRADER_VERSION:
            lines.append(f"grader: records graded by {self.recorded_grader or 'an unnoted version'}, now "
                         f"{grading.GRADER_VERSION}: a verdict that differs may be a change of the rules")
        if self.host_differs == ("host",):
            lines.append("host: not recorded (records written before host fingerprints); compared at the level of tokens")
        elif self.host_differs:
            lines.append(f"host: DIFFERENT ({', '.join(self.host_differs)} differ); "
                         + ("the tokens cannot be expected to match: compared at the level of answers "
                            "(finish reason, extracted answer, verdict); token and meter differences listed"
                            if self.level == "answers" else
                            "the run is ISA-independent (float32, kernels pinned): compared at the level of tokens"))
        else:
            lines.append("host: same (instruction sets, kernel libraries, threads); compared at the level of tokens")
        return lines

    def summary(self) -> str:
        if self.level == "answers":
            same = sum(1 for c in self.checks if not c.differing(ANSWER_FIELDS))
            return f"{same} of {len(self.checks)} record(s) give the same answers (tokens not compared: another host)"
        same = sum(1 for c in self.checks if c.difference is None and not c.fields)
        return f"{same} of {len(self.checks)} record(s) identical"


def field_differences(recorded: dict, reproduced: dict) -> tuple[FieldDifference, ...]:
    """The `ANSWER_FIELDS` and `METER_FIELDS` whose values differ (a field the record lacks, as
    in records written before it existed, is not compared)."""
    return tuple(FieldDifference(k, recorded[k], reproduced.get(k)) for k in (*ANSWER_FIELDS, *METER_FIELDS)
                 if k in recorded and recorded[k] != reproduced.get(k))


def comparison_level(config: dict, recorded_host, current_host: dict) -> tuple[tuple[str, ...], str]:
    """(fingerprint keys that differ, level compared): tokens unless the host differs and the run
    is not ISA-independent (float32 with `PORTABLE_ENV` pinned on both hosts)."""
    differs = tuple(host_differences(recorded_host, current_host))
    if not differs or differs == ("host",):
        return differs, "tokens"
    pinned = all(isinstance(h, dict) and h.get("env") == PORTABLE_ENV for h in (recorded_host, current_host))
    portable = pinned and config.get("dtype", "float32") == "float32"
    return differs, "tokens" if portable else "answers"


def _stats_path(config: dict, stats: str | None) -> str | None:
    """The statistics file to rebuild the arm with: given, else the model's default (its sha256 is
    checked against the recorded one by `validate_arm`)."""
    if "stats_sha256" not in config:
        return None
    if stats is not None:
        return stats
    return str(default_stats_path(config["model"]))


def rebuild_arm(meta: dict, stats: str | None = None):
    """The `ArmSpec` of a run's `config.json`, validated as `run`
    validates it. Refuses a configuration that no longer rebuilds to the recorded one."""
    recorded = meta.get("config")
    if not isinstance(recorded, dict):
        raise RetentionError("config.json has no 'config' object")
    cfg = {k: v for k, v in recorded.items() if k not in _LOADED_KEYS and k != "nominal_b"}
    params = dict(cfg.get("scorer_params") or {})
    path = _stats_path(recorded, stats)
    if path is not None:
        params["stats"] = path
    cfg["scorer_params"] = params
    spec = validate_arm(cfg)
    rebuilt = dict(spec.config, **{k: recorded[k] for k in _LOADED_KEYS if k in recorded})
    if rebuilt != recorded:
        keys = differing_keys(recorded, rebuilt)
        raise RetentionError(f"the recorded configuration does not rebuild with this code ({', '.join(keys)} "
                             "differ): it cannot be re-run as recorded")
    return spec


def reproduce(run_dir: Path, *, limit: int | None = None, stats: str | None = None,
              splits_dir=None) -> Reproduction:
    """Decode the first `limit` records of `run_dir` (all when None) again and compare their tokens."""
    current_code = code_version()  # now: the code imported is the code of the start, not of the end
    run_dir = Path(run_dir)
    meta = load_json_object(run_dir / "config.json", "run configuration")
    config = meta.get("config")
    if not isinstance(config, dict) or config_hash(config) != meta.get("config_hash"):
        raise RetentionError(f"{run_dir / 'config.json'}: its config does not hash to its config_hash")
    if config.get("engine", "hf") != "hf":
        raise RetentionError(f"reproduce re-runs this project's engine only; this run used {config['engine']!r}")
    records_path = run_dir / "records.jsonl"
    if not records_path.is_file():
        raise RetentionError(f"{records_path} not found (a sharded run: `retention merge` it first)")
    records = read_jsonl(records_path, "record").objects[:limit]
    if not records:
        raise RetentionError(f"{records_path} holds no record to reproduce")
    spec = rebuild_arm(meta, stats)
    settings = RunSettings.from_config(config, splits_dir=splits_dir)  # the run's problems, model and sampling
    listed = settings.problems.load()
    problems = {p.unique_id: p for p in listed}
    missing = [r["problem_id"] for r in records if r.get("problem_id") not in problems]
    if missing:
        raise RetentionError(f"problem(s) {missing[:3]} of the records are not in the run's split")
    loaded = on_reference_mla(load_model(settings.model, dtype=settings.dtype, device=settings.device))
    if loaded.revision != config.get("model_revision"):
        raise RetentionError(f"{config['model']} loads as revision {loaded.revision}, the run recorded "
                             f"{config.get('model_revision')}: not the same model")
    sampling = SamplingConfig(**settings.sampling.engine_args(), sampler=settings.sampling.drawn_with)
    got: dict[tuple[str, int], list[int]] = {}
    by_slots: dict[int, list[dict]] = {}
    prompts = run_prompts(loaded, listed)  # the run's longest prompt sized its rows: size them alike
    longest = max(map(len, prompts.values()), default=0)
    for r in records:  # each record at the slot count it was decoded at
        by_slots.setdefault(int(r.get("slots") or r.get("batch_size") or 1), []).append(r)
    for slots, group in by_slots.items():
        reqs = []
        for r in group:
            p = problems[r["problem_id"]]
            seed = derive_seed(settings.sampling.seed, p.unique_id, r["sample"])
            if seed != r.get("seed"):
                raise RetentionError(f"{p.unique_id} sample {r['sample']}: recorded seed {r.get('seed')} is not "
                                     f"the seed its configuration derives ({seed})")
            reqs.append(Request((p.unique_id, r["sample"]), prompts[p.unique_id], seed))
        policy = spec.policy()  # all five mechanisms, as the run built them
        policy.prepare(loaded.tokenizer)

        def on_finish(req, g):
            got[req.key] = g

        run_engine(loaded.model, reqs, policy, sampling, _eos_ids(loaded), loaded.geometry.kib_per_token,
                   batch_size=slots, fidelity=settings.fidelity, on_finish=on_finish,
                   max_prompt=longest)
    reproduced = {}
    for r in records:
        g, p = got[(r["problem_id"], r["sample"])], problems[r["problem_id"]]
        reproduced[(r["problem_id"], r["sample"])] = {
            "text": output_text(loaded.tokenizer, prompts[p.unique_id], list(g.token_ids)),
            "finish_reason": g.finish_reason, **g.meter.summary()}
    # graded as `run` grades (problem text, finish reason): an edited verdict shows here
    graded = [r for r in records if r.get("gold") is not None  # a --no-grade record has no grade to compare
              and any(r.get(k) is not None for k in ("verdict", "reason", "rule"))]
    grades = grading.grade_many(
        [(reproduced[(r["problem_id"], r["sample"])]["text"], r["gold"]) for r in graded],
        problems=[problems[r["problem_id"]].problem for r in graded],
        finish_reasons=[reproduced[(r["problem_id"], r["sample"])]["finish_reason"] for r in graded])
    for r, gr in zip(graded, grades):
        reproduced[(r["problem_id"], r["sample"])].update(extracted=gr.extracted, verdict=gr.verdict)
    checks = []
    for r in records:
        again = reproduced[(r["problem_id"], r["sample"])]
        checks.append(RecordCheck(r["problem_id"], r["sample"], tuple(r["output_token_ids"]),
                                  tuple(got[(r["problem_id"], r["sample"])].token_ids),
                                  field_differences(r, again)))
    differs, level = comparison_level(config, records[0].get("host", meta.get("host")), host_fingerprint())
    return Reproduction(run_dir, meta["config_hash"], loaded.revision, str(meta.get("code_version")),
                        current_code, tuple(checks), differs, level, records[0].get("grader_version"))
