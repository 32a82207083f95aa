"""The Python API for notebooks: run one arm without the command line.

    from retention.api import run_arm, records_frame
    recs = run_arm("tiny-random", "alpha", budget=40, limit=2, max_new_tokens=64, params={"lam": 0.5})
    df = records_frame(recs)

`run_arm` builds the run's settings (`retention.runs.settings.RunSettings`) and the arm exactly as
`retention run` does (`RunSettings.from_options`, `retention.runs.arms.validate_arm`) and generates
through the same job (`retention.runs.jobs.execute`), so it writes, and resumes, the same run directory
under `out` as the equivalent `retention run` command. The scorer is a name or spec (as `--scorer`
takes) or a `Scorer` instance: its class is named by its importable `module:qualname` (or, for a
class defined in a notebook, that text registered for this process) and its public dataclass fields
become the arm's parameters; the class's source sha256 is part of the configuration either way.
With `trace=True` the run directory's `trace.jsonl` also holds what each record's cache held;
`traces(run_dir)` reads it back as `retention.runtime.trace.CacheTrace` objects.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from protocol.io import read_jsonl
from retention.errors import RetentionError
from retention.plugins import register_class
from retention.policy.registry import new_run_config
from retention.runs.arms import validate_arm
from retention.runs.jobs import execute
from retention.runs.settings import Budget, RunSettings
from retention.runtime.sampling import DEFAULT_SAMPLER
from retention.runtime.trace import CacheTrace
from retention.policy.scoring.base import Scorer
from retention.policy.registry import get_scorer_class, is_builtin


def _scorer_arm(scorer, params: dict | None) -> tuple[str, dict]:
    """(name or spec, parameters) of a scorer given by name or as an instance."""
    params = dict(params or {})
    if isinstance(scorer, str):
        return scorer, params
    if not isinstance(scorer, Scorer):
        raise RetentionError(f"scorer must be a name, a spec or a retention.scorers.Scorer instance, got {scorer!r}")
    if params:
        raise RetentionError("give parameters on the scorer instance, not also as params")
    cls = type(scorer)
    name = getattr(cls, "name", None)
    if not (isinstance(name, str) and is_builtin("scorer", name) and _builtin_class(name) is cls):
        name = register_class(cls, Scorer)
    fields = {f.name: getattr(scorer, f.name) for f in dataclasses.fields(scorer)
              if f.init and not f.name.startswith("_") and f.name != "seed"}
    return name, fields


def _builtin_class(name: str):
    return get_scorer_class(name)


def run_arm(model: str, scorer, budget: int | None = None, *, params: dict | None = None, limit: int | None = None,
            split: str = "dev", samples: int = 1, seed: int = 0, max_new_tokens: int = 8192,
            temperature: float = 0.6, top_p: float = 0.95, sampler: str = DEFAULT_SAMPLER, ignore_eos: bool = False,
            interval: int | None = None,
            accounting: str = "mean", sink: int | None = None, recent: int | None = None,
            protect_prompt: bool = False, protect_prompt_counted: bool | None = None, dtype: str = "float32", device: str = "cpu", data_path: str | None = None,
            out: str | Path = "results", batch_size: int | None = None, grade: bool = True,
            progress: bool = False, mechanisms: dict | None = None, trace: bool = False) -> list[dict]:
    """Generate one arm on the first `limit` problems of the dev split and return its records (the
    dicts of `records.jsonl`, docs/records.md), resuming the run directory if it exists.

    scorer: a built-in name, a plugin name or spec, or a `Scorer` instance; params: its parameters
    (names as its dataclass fields, e.g. {"lam": 0.5}) when given by name. mechanisms: the other
    families, `{"state": {"name": "quant", "params": {"bits": 4}}, "decoding": "loop-guard"}` (as in a
    plan's arm). trace: record what each record's cache held (`--trace`; read the run directory's
    trace.jsonl with `traces`). The other arguments are `retention run`'s options of the same names.
    """
    if split != "dev":
        raise RetentionError("the confirm split is reachable only through a pre-registered plan (retention confirm)")
    name, scorer_params = _scorer_arm(scorer, params)
    settings = RunSettings.from_options(
        model, dtype=dtype, device=device, split=split, data_path=data_path, limit=limit, samples=samples,
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, sampler=sampler, seed=seed,
        ignore_eos=ignore_eos, trace=trace, grade=grade, out=out, batch_size=batch_size, progress=progress)
    budget = Budget(budget, None, interval, accounting, sink, recent, protect_prompt, protect_prompt_counted)
    arm = new_run_config(dict(scorer=name, scorer_params=scorer_params, **(mechanisms or {})))  # a new run's defaults
    spec = validate_arm(arm, settings=settings, budget=budget)
    (run_dir,) = execute(settings, [spec])
    return read_jsonl(Path(run_dir) / "records.jsonl", "record").objects


def traces(run_dir) -> dict[tuple[str, int], object]:
    """{(problem_id, sample): `retention.runtime.trace.CacheTrace`} of a run directory written with
    `trace=True` (`--trace`); records without a cache trace are left out."""
    rows = read_jsonl(Path(run_dir) / "trace.jsonl", "trace").objects
    return {(r["problem_id"], r["sample"]): CacheTrace.from_json(r["cache"]) for r in rows if "cache" in r}


def records_frame(records: list[dict]):
    """The records as a pandas DataFrame, one row per (problem, sample); nested fields flattened
    (`fidelity.kl_mean`, ...)."""
    return pd.json_normalize(records)
