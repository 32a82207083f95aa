"""Runs: a resolved configuration, a run directory, resumable append-only records.

A run directory (`<out>/<run-id>/`) holds `config.json`, `records.jsonl` (one line per (problem,
sample), flushed as each finishes) and `trace.jsonl` (per-record cache trace). The run id ends with
the configuration hash, so rerunning the same command finds the same directory and resumes:
finished records are skipped, a half-written last line is discarded, nothing is duplicated.

Several arms (e.g. `alpha` vs `triattention`) run interleaved over the same problems with the same
seed per (problem, sample), so an interrupted comparison stays paired.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from retention import __version__
from retention.errors import RetentionError

# Bumped when the meaning of a configuration field changes; plans and ledgers record it.
CONFIG_SCHEMA_VERSION = 1


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def config_hash(config: dict) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


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
            return f"{__version__}+g{out.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def library_versions() -> dict:
    import torch
    import transformers

    return {
        "retention": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def run_id_for(config: dict) -> str:
    model = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(config["model"])).name) or "model"
    budget = "full" if config.get("budget") is None else f"b{config['budget']}"
    return f"{model}-{config['scorer']}-{budget}-{config_hash(config)[:10]}"


class RecordStore:
    """Append-only `records.jsonl` with crash-safe resume."""

    def __init__(self, path: Path):
        self.path = path
        self.done: dict[tuple[str, int], dict] = {}
        self._repair_and_load()

    def _repair_and_load(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        good = data.rfind(b"\n") + 1  # a last line without newline was cut mid-write
        lines = data[:good].splitlines()
        valid_end = 0
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a corrupted line: keep what precedes it
            self.done[(rec["problem_id"], rec["sample"])] = rec
            valid_end += len(line) + 1
        if valid_end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(valid_end)

    def has(self, problem_id: str, sample: int) -> bool:
        return (problem_id, sample) in self.done

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[(record["problem_id"], record["sample"])] = record


@dataclass
class RunDir:
    """One arm's run directory."""

    path: Path
    config: dict
    # A shard of a run writes its own files (retention.shard): records.shard-I-of-N.jsonl, ...
    records_name: str = "records.jsonl"
    trace_name: str = "trace.jsonl"
    records: RecordStore = field(init=False)

    def __post_init__(self):
        self.path.mkdir(parents=True, exist_ok=True)
        cfg_file = self.path / "config.json"
        h = config_hash(self.config)
        if cfg_file.exists():
            existing = json.loads(cfg_file.read_text())
            if existing.get("config_hash") != h:
                raise RetentionError(f"{cfg_file} belongs to another configuration; choose another --out")
        else:
            meta = {
                "run_id": self.path.name,
                "config_hash": h,
                "config_schema": CONFIG_SCHEMA_VERSION,
                "config": self.config,
                "versions": library_versions(),
                "code_version": code_version(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            tmp = cfg_file.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            tmp.replace(cfg_file)
        self.records = RecordStore(self.path / self.records_name)

    @property
    def hash(self) -> str:
        return config_hash(self.config)

    def append_trace(self, problem_id: str, sample: int, steps: list[int], tokens: list[float]) -> None:
        with open(self.path / self.trace_name, "a", encoding="utf-8") as f:
            f.write(json.dumps({"problem_id": problem_id, "sample": sample, "steps": steps, "tokens": tokens}) + "\n")


def open_run(out: Path, config: dict, shard=None) -> RunDir:
    """The run directory of `config` under `out`; a `retention.shard.Shard` writes its own files."""
    if shard is None:
        return RunDir(Path(out) / run_id_for(config), config)
    return RunDir(Path(out) / run_id_for(config), config, shard.records_name, shard.trace_name)


@dataclass
class Arm:
    """One policy of a run: where its records go and how to build its scorer."""

    run: RunDir
    scorer: str
    scorer_params: dict
    cadence: "Cadence"  # noqa: F821 (imported lazily: keeps this module light)


def run_arms(loaded, arms: list[Arm], problems, *, samples: int, base_seed: int, sampling: dict,
             fidelity: bool = False, grade: bool = True, progress: bool = True, shard=None) -> None:
    """Generate every missing (problem, sample) record of every arm, interleaved.

    loaded: a `retention.models.LoadedModel`; problems: objects with `unique_id`, `problem`,
    `answer`; sampling: `max_new_tokens`, `temperature`, `top_p`, `ignore_eos`. shard: a
    `retention.shard.Shard` to generate only its pairs (None: all of them).
    """
    from tqdm import tqdm

    from retention.generate import SamplingConfig, generate
    from retention.models import format_prompt
    from retention.policy import RetentionPolicy
    from retention.scorers import make_scorer

    grader = None
    if grade:
        from protocol.grading import grade as grader

    tok = loaded.tokenizer
    eos = _eos_ids(loaded)
    kib = loaded.geometry.kib_per_token
    from retention.shard import shard_pairs

    pairs = [(problems[i], s) for i, s in shard_pairs(len(problems), samples, shard)]
    todo = [(p, s, a) for p, s in pairs for a in arms if not a.run.records.has(p.unique_id, s)]
    total = len(pairs) * len(arms)
    bar = tqdm(total=total, initial=total - len(todo), disable=not progress, unit="gen", dynamic_ncols=True)
    prompts: dict[str, list[int]] = {}
    for p, s, arm in todo:
        prompt = prompts.setdefault(p.unique_id, format_prompt(tok, p.problem))
        seed = derive_seed(base_seed, p.unique_id, s)
        policy = RetentionPolicy(make_scorer(arm.scorer, seed=seed, **arm.scorer_params), arm.cadence)
        cfg = SamplingConfig(seed=seed, **sampling)
        t_start = time.perf_counter()

        def on_token(n, meter, _t=t_start, _arm=arm):
            if n % 16 == 0:
                bar.set_postfix_str(
                    f"{_arm.scorer} {n / (time.perf_counter() - _t):.1f} tok/s mean cache {meter.mean:.1f}", refresh=False)
                bar.refresh()

        g = generate(loaded.model, prompt, policy, cfg, eos, kib, fidelity=fidelity, on_token=on_token if progress else None)
        text = tok.decode(g.token_ids, skip_special_tokens=True)
        record = {
            "config_hash": arm.run.hash,
            "problem_id": p.unique_id,
            "sample": s,
            "seed": seed,
            "prompt_tokens": len(prompt),
            "output_token_ids": g.token_ids,
            "output_tokens": len(g.token_ids),
            "text": text,
            "finish_reason": g.finish_reason,
            **g.meter.summary(),
            "budget": arm.cadence.budget,
            "accounting": arm.cadence.accounting,
            "wall_seconds": g.wall_seconds,
            "tokens_per_second": len(g.token_ids) / g.wall_seconds if g.wall_seconds > 0 else 0.0,
            "gold": getattr(p, "answer", None),
        }
        if g.fidelity is not None:
            record["fidelity"] = g.fidelity.summary()
        if grader is not None and record["gold"] is not None:
            gr = grader(text, record["gold"])
            record.update(extracted=gr.extracted, verdict=gr.verdict, reason=gr.reason, rule=gr.rule)
        else:
            record.update(extracted=None, verdict=None, reason=None, rule=None)
        steps, tokens = g.meter.trace()
        arm.run.append_trace(p.unique_id, s, steps, tokens)
        arm.run.records.append(record)
        bar.update(1)
    bar.close()


def _eos_ids(loaded) -> set[int]:
    ids = set()
    for src in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(i) for i in src)
    return ids
