"""`retention run`: generate under one or several retention policies on the dev split."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import click

from protocol.errors import ProtocolError
from protocol.io import check_writable_dir
from retention.cli.options import splits_dir_option
from retention.errors import RetentionError


# What `--engine` (and a plan arm's "engine") may name: this project's batched engine, the reference
# modules for DeepSeek checkpoints, vLLM for non-evicting arms.
ENGINES = ("hf", "reference", "vllm")


def _bounded(name, lo, hi, lo_open=False):
    """A callback refusing values outside [lo, hi] (or (lo, hi]) and non-finite floats (click's
    FloatRange lets nan through: every comparison with it is false)."""
    def check(ctx, param, value):
        if value is None:
            return value
        if not math.isfinite(value) or (value <= lo if lo_open else value < lo) or value > hi:
            raise click.BadParameter(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param_hint=name)
        return value

    return check


def _positive(name):
    def check(ctx, param, value):
        if value is not None and value <= 0:
            raise click.BadParameter(f"must be > 0, got {value}", param_hint=name)
        return value

    return check


def _scorer_list(value: tuple[str, ...]) -> list[str]:
    names = [n.strip() for v in value for n in v.split(",") if n.strip()]
    if not names:
        raise RetentionError("--scorer needs at least one scorer name")
    return list(dict.fromkeys(names))


def build_arm_config(base: dict, scorer: str, options: dict) -> tuple[dict, dict, "Cadence"]:  # noqa: F821
    """The full configuration of one arm, its scorer parameters and its cadence."""
    from retention.policy import cadence_for
    from retention.scorers import get_scorer_class

    cls = get_scorer_class(scorer)
    fields = {f.name for f in dataclasses.fields(cls)} - {"seed"}
    params = {k: v for k, v in options.items() if k in fields and v is not None}
    scorer_obj = cls(**params)  # validates parameters now, not in the middle of a run
    params = {k: getattr(scorer_obj, k) for k in sorted(fields) if not k.startswith("_")}
    extra = {}
    if "stats" in params:
        params["stats"], extra["stats_sha256"] = _resolve_stats(params["stats"], base["model"])
    if cls.evicts and base["budget"] is None:
        raise RetentionError(f"--budget is required for scorer {scorer!r}")
    cadence = cadence_for(scorer_obj, base["budget"], base["interval"], base["accounting"], base["sink"], base["recent"],
                          protect_prompt=bool(base.get("protect_prompt")))
    budget, interval, sink, recent = cadence.budget, cadence.interval, cadence.sink, cadence.recent
    config = dict(base, scorer=scorer, scorer_params=params, budget=budget, interval=interval,
                  sink=sink, recent=recent, nominal_b=cadence.nominal, **extra)
    return config, params, cadence


def _resolve_stats(path: str | None, model: str) -> tuple[str, str]:
    """The calibration statistics file a scorer will use (given, or the model's default) and its
    sha256, so that the configuration hash names the statistics and not just a path."""
    import hashlib

    from retention.calibration import default_stats_path

    resolved = Path(path) if path else default_stats_path(model)
    if not resolved.is_file():
        hint = "" if path else f" (the default for {model})"
        raise RetentionError(f"no calibration statistics at {resolved}{hint}; run `retention calibrate "
                             f"--model {model}` first or pass --stats FILE")
    return str(resolved.resolve()), hashlib.sha256(resolved.read_bytes()).hexdigest()


@click.command("run")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="Model alias (r1-distill-qwen-7b, r1-distill-llama-8b, smollm2-135m, tiny-random; reference "
                   "layout models tiny-kv, tiny-cla, tiny-mla, tiny-qk-norm-mla, tiny-path-concat, tiny-path-residual, "
                   "tiny-path-mla) or a local folder.")
@click.option("--scorer", "scorers", multiple=True, default=("alpha",), show_default=True,
              help="Retention scorer; several as a comma list or repeated option run over the same problems.")
@click.option("--baseline", default=None, help="Also run this scorer as the baseline arm (same seeds, same problems).")
@click.option("--budget", type=int, callback=_positive("--budget"),
              help="Cache budget B in tokens per (layer, KV head); its meaning depends on --accounting.")
@click.option("--budget-bytes", "budget_kib", type=float, default=None,
              help="Cache budget in KiB per sequence instead of --budget: the tokens that many KiB of the model's "
                   "cache layout hold, so layouts compare at matched memory.")
@click.option("--interval", type=int, callback=_positive("--interval"),
              help="Compaction interval N (compact when the cache reaches b + N). Default: min(128, B).")
@click.option("--accounting", type=click.Choice(["mean", "prefill", "peak"]), default="mean", show_default=True,
              help="mean: B is the measured mean cache; peak: never above B; prefill: B right after compaction.")
@click.option("--sink", type=int, default=None, help="Protected first tokens (default: the scorer's, 4 for streaming).")
@click.option("--recent", type=int, default=None, help="Protected most recent tokens (default: the scorer's).")
@click.option("--protect-prompt", is_flag=True,
              help="The reference rule: prompt tokens are never evicted nor candidates; b + N applies to the "
                   "generated tokens (the meter still counts the prompt).")
@click.option("--param", "params", multiple=True, metavar="SCORER.NAME=VALUE",
              help="One scorer's parameter, e.g. --param alpha.lam=0.5 --param rkv.lam=0.1 (repeatable).")
@click.option("--lambda", "lam", type=float, default=None, help="Deprecated alias of --param alpha.lam / rkv.lam (defaults: alpha 0.5, rkv 0.1); refused when both are listed.")
@click.option("--radius", type=float, default=None, help="alpha: cosine radius under which no penalty applies (default 0).")
@click.option("--window", type=int, default=None, help="snapkv/rkv/h2o: recent query/window size (default 8).")
@click.option("--routing", type=click.Choice(["shared", "per-layer"]), default=None,
              help="triattention/alpha: one kept set per KV head for all layers (shared) or per layer.")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False), default=None,
              help="triattention/alpha: calibration statistics (default: the model's default location).")
@click.option("--split", type=click.Choice(["dev", "confirm"]), default="dev", show_default=True,
              help="Problems of this frozen split (confirm only through `retention confirm --plan`).")
@click.option("--data", "data_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="MATH-500 JSONL (default: the copy shipped with the package); verified against the split manifest.")
@splits_dir_option
@click.option("--limit", type=int, default=None, callback=_positive("--limit"), help="Only the first N problems of the split.")
@click.option("--samples", type=int, default=1, show_default=True, callback=_positive("--samples"), help="Samples k per problem.")
@click.option("--max-new-tokens", type=int, default=8192, show_default=True, callback=_positive("--max-new-tokens"))
@click.option("--temperature", type=float, default=0.6, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=0.95, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Base seed; each (problem, sample) derives its own.")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly --max-new-tokens (tests, benchmarks).")
@click.option("--fidelity", is_flag=True, help="Also decode with the full cache and record per-step KL and top-1 agreement.")
@click.option("--no-grade", is_flag=True, help="Do not grade records as they are written.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, mps.")
@click.option("--out", type=click.Path(file_okay=False), default="results", show_default=True, help="Parent folder of run directories.")
@click.option("--batch-size", type=int, default=None, callback=_bounded("--batch-size", 1, 65536),
              help="Sequences decoded together (continuous batching). Default: chosen for the device and budget, printed.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--shard", "shard_text", default=None, metavar="I/N|auto",
              help="Generate only shard I of N of the (problem, sample) pairs, into records.shard-I-of-N.jsonl; "
                   "auto: from SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT or RANK/WORLD_SIZE. Merge with `retention merge`.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run --shards N shards as Ray tasks and merge them: alone, a private local cluster; "
                   "with ADDRESS (auto, ray://head:10001) an existing cluster. Needs `pip install 'retention[ray]'`.")
@click.option("--shards", type=int, default=None, help="With --ray: number of shards (e.g. one per GPU).")
@click.option("--gpus-per-shard", type=float, default=None, callback=_bounded("--gpus-per-shard", 0, 1024),
              help="With --ray: GPUs per shard [default: 1 with --device cuda, else 0 (CPU workers)].")
@click.option("--cpus-per-shard", type=float, default=None, callback=_bounded("--cpus-per-shard", 0, 1024, lo_open=True),
              help="With --ray: CPUs per shard [default: 1].")
@click.option("--retries", type=int, default=None, callback=_bounded("--retries", 0, 100),
              help="With --ray: times a shard whose worker died is restarted (it resumes from its records) [default: 3].")
@click.option("--engine", type=click.Choice(ENGINES), default="hf", show_default=True,
              help="hf: this project's batched engine (every scorer); reference: a DeepSeek-V2/V3 checkpoint on the "
                   "reference MLA modules (latent-cache h2o and snapkv too); vllm: vLLM's offline API for "
                   "non-evicting arms (full).")
def run_command(model, scorers, baseline, budget, budget_kib, interval, accounting, sink, recent, protect_prompt, params, lam, radius,
                window, routing, stats_path, split, data_path, splits_dir, limit, samples, max_new_tokens, temperature, top_p,
                seed, ignore_eos, fidelity, no_grade, dtype, device, out, batch_size, quiet, shard_text, ray_address,
                shards, gpus_per_shard, cpus_per_shard, retries, engine):
    """Generate on the dev split under retention policies and write resumable run directories.

    Rerunning the same command resumes: finished records are skipped.
    """
    if split == "confirm":
        raise RetentionError("the confirm split is reachable only through a pre-registered plan: "
                             "`retention preregister` then `retention confirm --plan PLAN.json`")
    from retention.shard import parse_shard

    shard = parse_shard(shard_text)
    names = _scorer_list(scorers)
    if baseline and baseline not in names:
        names.append(baseline)
    budget = budget_from_bytes(model, dtype, budget, budget_kib)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "ignore_eos": ignore_eos}
    from retention.cli.scorer_options import resolve

    shared = {"--lambda": lam, "--radius": radius, "--window": window, "--routing": routing, "--stats": stats_path}
    options = resolve(names, shared, params)  # per listed scorer; an option no listed scorer takes is an error
    if lam is not None:
        click.echo("warning: --lambda is deprecated; use --param SCORER.lam=VALUE", err=True)
    base = {"model": model, "dtype": dtype, "device": device, "budget": budget, "interval": interval,
            "accounting": accounting, "sink": sink, "recent": recent, "protect_prompt": protect_prompt,
            "split": split, "data": data_path, "limit": limit, "samples": samples, "seed": seed,
            "fidelity": fidelity, **sampling}
    if budget_kib is not None:
        base["budget_kib"] = budget_kib
    if engine == "reference":  # its own numerics: its runs never share a configuration with hf's
        base["engine"] = engine
    # Validate every arm (the same function `preregister` and `confirm` use) before loading a
    # model or touching the output folder.
    arm_specs = [validate_arm(dict(base, scorer=name, scorer_params={k: v for k, v in options[name].items()
                                                                     if v is not None}))
                 for name in names]
    job = dict(model=model, dtype=dtype, device=device, arm_specs=arm_specs, split=split, data_path=data_path,
               limit=limit, samples=samples, seed=seed, sampling=sampling, fidelity=fidelity, grade=not no_grade,
               out=Path(out), batch_size=batch_size, splits_dir=splits_dir, engine=engine)
    ray_opts = None
    given = [f for f, v in (("--gpus-per-shard", gpus_per_shard), ("--cpus-per-shard", cpus_per_shard),
                            ("--retries", retries)) if v is not None]
    if given and ray_address is None:
        raise RetentionError(f"{', '.join(given)} only apply with --ray (they would be ignored)")
    cpus_per_shard = 1.0 if cpus_per_shard is None else cpus_per_shard
    retries = 3 if retries is None else retries
    if ray_address is not None or shards is not None:
        from retention.launch_ray import ray_options

        ray_opts = ray_options(job, address=ray_address, shards=shards, gpus_per_shard=gpus_per_shard,
                               cpus_per_shard=cpus_per_shard, retries=retries, shard=shard)
    check_writable_dir(Path(out), "--out")
    _announce_size(arm_specs, split, data_path, limit, samples, max_new_tokens, device)
    if ray_opts is not None:
        from retention.launch_ray import launch_from_cli

        run_dirs = launch_from_cli(job, ray_opts, progress=not quiet)
        shard = None  # merged
    else:
        run_dirs = execute(**job, progress=not quiet, shard=shard)
    for d in run_dirs:
        click.echo(_summary_line(d, shard))


def budget_from_bytes(model: str, dtype: str, budget: int | None, budget_kib: float | None) -> int | None:
    """The token budget: --budget, or --budget-bytes converted through the model's cache layout."""
    if budget_kib is None:
        return budget
    from retention.layouts import tokens_for_bytes
    from retention.models import model_layout

    if budget is not None:
        raise RetentionError("give --budget (tokens) or --budget-bytes (KiB), not both")
    if not (0 < budget_kib < float("inf")):
        raise RetentionError(f"--budget-bytes must be a positive number of KiB, got {budget_kib:g}")
    return tokens_for_bytes(model_layout(model, dtype), budget_kib * 1024)


def execute(model, dtype, device, arm_specs, *, split, data_path, limit, samples, seed, sampling, fidelity, grade,
            out: Path, progress=True, problems=None, extra_config=None, shard=None, batch_size=None,
            splits_dir=None, engine="hf"):
    """Load the model and problems, open one run directory per arm, generate. Returns the run dirs.

    shard: a `retention.shard.Shard` to generate only its pairs (None: all); engine: "hf" (this
    project's), "reference" (a DeepSeek-V2/V3 checkpoint on `retention.arch.deepseek`) or an external
    engine of `retention.engines` (non-evicting arms only).
    batch_size: sequences decoded together; None chooses one for the device and budget (printed).
    It is not part of the configuration hash: records do not depend on it (batch invariance), so a
    run resumes at any batch size; each record notes the batch size it was decoded in."""
    from protocol.splits import load_split
    from retention.merge import open_shard_run
    from retention.models import load_model
    from retention.runner import Arm, auto_batch_size, run_arms

    if problems is None:
        problems = load_split(split, data_path=data_path, splits_dir=splits_dir)
        if limit:
            problems = problems[:limit]
    if engine not in ("hf", "reference"):
        from retention.engines.run import execute_with_engine

        return execute_with_engine(engine, model, dtype, device, arm_specs, problems, samples=samples, seed=seed,
                                   sampling=sampling, fidelity=fidelity, grade=grade, out=out, progress=progress,
                                   extra_config=extra_config, shard=shard)
    loaded = load_model(model, dtype=dtype, device=device)
    if engine == "reference":
        from retention.arch.deepseek import on_reference_engine

        loaded = on_reference_engine(loaded)
    arms = []
    for name, config, params, cadence in arm_specs:
        config = dict(config, model_id=loaded.model_id, model_revision=loaded.revision, **(extra_config or {}))
        arms.append(Arm(open_shard_run(out, config, shard), name, params, cadence))
    if batch_size is None:
        batch_size = min(auto_batch_size(loaded, a.cadence, sampling["max_new_tokens"]) for a in arms)
        click.echo(f"batch size {batch_size} (automatic for {loaded.device}; set it with --batch-size)", err=True)
    run_arms(loaded, arms, problems, samples=samples, base_seed=seed, sampling=sampling, fidelity=fidelity,
             grade=grade, progress=progress, shard=shard, batch_size=batch_size)
    return [a.run.path for a in arms]


def _summary_line(run_dir: Path, shard=None) -> str:
    from protocol.io import read_jsonl

    records = run_dir / (shard.records_name if shard else "records.jsonl")
    recs = read_jsonl(records, "record").objects if records.is_file() else []
    n = len(recs)
    correct = sum(1 for r in recs if r.get("verdict") is True)
    mean_cache = sum(r["cache_mean_tokens"] for r in recs) / n if n else 0.0
    tps = sum(r["tokens_per_second"] for r in recs) / n if n else 0.0
    over = sum(1 for r in recs if r["budget_exceeded"])
    where = f"{run_dir} (shard {shard})" if shard else f"{run_dir}"
    return (f"{where}: {n} records, accuracy {correct}/{n}, mean cache {mean_cache:.1f} tokens, "
            f"{tps:.1f} tok/s, budget exceeded in {over}")


# Keys a pre-registered arm configuration may set (the rest come from the plan: model, budget,
# samples, seed, max_new_tokens, split). Names are those of the run configuration (docs/records.md)
# so that `confirm` can compare what was planned with what ran, key by key.
_ARM_KEYS = {"scorer", "scorer_params", "stats_sha256", "interval", "accounting", "sink", "recent", "protect_prompt",
             "temperature", "top_p", "dtype", "device", "data", "limit", "fidelity", "ignore_eos", "engine"}


# Names a user may write for a scorer parameter (CLI spelling -> field name).
PARAM_ALIASES = {"lambda": "lam"}
# Upper bounds that keep a typo from allocating or generating without bound.
MAX_SAMPLES = 10_000
MAX_NEW_TOKENS = 1 << 20


def normalize_arm(cfg: dict) -> dict:
    """An arm configuration with parameter aliases resolved (`scorer_params.lambda` -> `lam`)."""
    cfg = dict(cfg)
    params = cfg.get("scorer_params")
    if isinstance(params, dict):
        cfg["scorer_params"] = {PARAM_ALIASES.get(k, k): v for k, v in params.items()}
    return cfg


def _number(cfg: dict, key: str, kind, flag: str, *, lo=None, hi=None, lo_open=False, default=None):
    value = cfg.get(key, default)
    if value is None:
        return None
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise RetentionError(f"{flag} must be a finite {'integer' if kind is int else 'number'}, got {value!r}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise RetentionError(f"{flag} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise RetentionError(f"{flag} must be <= {hi}, got {value!r}")
    return value


def validate_arm(cfg: dict):
    """Validate one arm's complete run configuration exactly as `run` will run it.

    The one validation of `run`, `preregister` (each arm of each cell) and `confirm` (before any
    generation): sampling numbers (finite, in range), model alias, dtype, device, split, scorer and
    its parameters, statistics file, budget/interval/accounting/sink/recent combination. cfg uses
    the run-configuration keys of docs/records.md (`run` resolves each listed scorer's own
    parameters first: `retention.cli.scorer_options`). Returns (scorer, config, params, cadence).
    """
    from retention.models import resolve_device, resolve_dtype, resolve_model

    cfg = normalize_arm(cfg)
    if not isinstance(cfg.get("scorer"), str) or not cfg["scorer"]:
        raise RetentionError("an arm configuration needs a 'scorer' name")
    if not isinstance(cfg.get("model"), str) or not cfg["model"]:
        raise RetentionError("an arm configuration needs a 'model'")
    ref = resolve_model(cfg["model"])
    resolve_dtype(str(cfg.get("dtype", "float32")))
    engine = cfg.get("engine", "hf")
    if engine not in ENGINES:
        raise RetentionError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if ref.kind in ("arch", "local") or engine == "reference":  # layouts that may refuse some scorers
        from retention.arch.retention import check_run_scorers
        from retention.models import model_layout

        layout = model_layout(cfg["model"], str(cfg.get("dtype", "float32")))
        if engine == "reference" and (ref.kind != "local" or layout.family != "mla"):
            what = "is a reference layout model, always decoded on these modules" if ref.kind == "arch" else (
                f"has a {layout.family} cache")
            raise RetentionError(f"--engine reference runs DeepSeek-V2/V3 (MLA) checkpoint folders; {cfg['model']} "
                                 f"{what}")
        check_run_scorers("arch" if engine == "reference" else ref.kind, layout, [cfg["scorer"]])
    resolve_device(str(cfg.get("device", "cpu")))
    _number(cfg, "temperature", float, "--temperature", lo=0, hi=100, default=0.6)
    _number(cfg, "top_p", float, "--top-p", lo=0, hi=1, lo_open=True, default=0.95)
    top_p = cfg.get("top_p", 0.95)
    if top_p is not None and top_p < 1e-6:
        raise RetentionError(f"--top-p must be at least 1e-6 (a nucleus of at least one token), got {top_p!r}")
    _number(cfg, "max_new_tokens", int, "--max-new-tokens", lo=1, hi=MAX_NEW_TOKENS, default=8192)
    _number(cfg, "samples", int, "--samples", lo=1, hi=MAX_SAMPLES, default=1)
    _number(cfg, "seed", int, "--seed", lo=0, hi=2**63 - 1, default=0)
    _number(cfg, "limit", int, "--limit", lo=1)
    for key, flag in (("budget", "--budget"), ("interval", "--interval")):
        _number(cfg, key, int, flag, lo=1)
    for key, flag in (("sink", "--sink"), ("recent", "--recent")):
        _number(cfg, key, int, flag, lo=0)
    if cfg.get("accounting", "mean") not in ("mean", "prefill", "peak"):
        raise RetentionError(f"--accounting must be mean, prefill or peak, got {cfg.get('accounting')!r}")
    if cfg.get("split", "dev") not in ("dev", "confirm"):
        raise RetentionError(f"--split must be dev or confirm, got {cfg.get('split')!r}")
    for key in ("fidelity", "ignore_eos"):
        if not isinstance(cfg.get(key, False), bool):
            raise RetentionError(f"{key} must be true or false, got {cfg.get(key)!r}")
    params = cfg.get("scorer_params") or {}
    if not isinstance(params, dict):
        raise RetentionError(f"scorer_params must be an object, got {params!r}")
    from retention.cli.scorer_options import scorer_fields

    fields = set(scorer_fields(cfg["scorer"]))
    unknown = sorted(set(params) - fields)
    if unknown:
        raise RetentionError(f"scorer {cfg['scorer']!r} has no parameter(s) {unknown}; it takes "
                             f"{sorted(fields)}" + (" (lambda is spelled lam or lambda)" if "lam" in fields else ""))
    options = {k: v for k, v in params.items() if k in fields}
    if "stats" in options and options["stats"] is not None and not isinstance(options["stats"], str):
        raise RetentionError(f"--stats must be a file path, got {options['stats']!r}")
    base = {k: v for k, v in cfg.items() if k not in ("scorer", "scorer_params", "stats_sha256")}
    base.setdefault("interval", None)
    base.setdefault("accounting", "mean")
    base.setdefault("sink", None)
    base.setdefault("recent", None)
    base.setdefault("budget", None)
    try:
        config, built, cadence = build_arm_config(base, cfg["scorer"], options)
    except TypeError as exc:  # a parameter of the wrong type reached the scorer's constructor
        raise RetentionError(f"scorer {cfg['scorer']!r}: bad parameter ({exc})") from None
    if built.get("stats"):
        _check_stats_file(Path(built["stats"]))
    return cfg["scorer"], config, built, cadence


def _check_stats_file(path: Path) -> None:
    """Read a statistics file now: one that is not statistics fails here, not mid-run."""
    from retention.calibration import QueryStats

    try:
        QueryStats.load(path)
    except RetentionError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise RetentionError(f"{path} is not a retention statistics file (safetensors: {exc})") from None


def _announce_size(arm_specs, split, data_path, limit, samples, max_new_tokens, device) -> None:
    """On a CPU without --limit, say how much is about to be generated (a bare `run` is 201 problems
    x 8,192 tokens per arm: days on a laptop)."""
    if limit or not str(device).startswith("cpu"):
        return
    from protocol.splits import COUNTS

    n = COUNTS.get(split, 0)
    total = n * samples * len(arm_specs) * max_new_tokens
    click.echo(f"note: no --limit on a CPU: up to {n} problems x {samples} sample(s) x {len(arm_specs)} arm(s) x "
               f"{max_new_tokens:,} tokens = {total:,} tokens to generate (use --limit N to try a few)", err=True)


def validate_plan_arm(name: str, arm: dict) -> None:
    """The keys of a plan's arm configuration (the rest come from the plan and its cells)."""
    if not isinstance(arm, dict):
        raise RetentionError(f"the {name} configuration must be a JSON object")
    unknown = sorted(set(arm) - _ARM_KEYS)
    if unknown:
        raise RetentionError(f"{name} configuration has unknown key(s) {unknown}; allowed: {sorted(_ARM_KEYS)}")


def validate_plan(plan: dict) -> None:
    """Every arm of every cell of a plan, validated as `run` validates an arm (`validate_arm`)."""
    from protocol.prereg import ARMS, arm_config

    for arm in ARMS:
        validate_plan_arm(arm, plan[arm])
    for cell in plan["cells"]:
        for arm in ARMS:
            try:
                validate_arm(arm_config(plan, "0" * 64, cell, arm))
            except RetentionError as exc:
                raise RetentionError(f"{arm} of cell {cell['id']}: {exc}") from None


def confirm_runner(cell: dict, arm: str, arm_config: dict, out_dir: Path, *, splits_dir=None, shard=None) -> Path:
    """The generation runner of `retention confirm` (contract in `protocol.prereg`).

    Runs one arm of one registered cell on the confirm split through the same code as
    `retention run`, resuming an interrupted run; returns its run directory. shard: only that
    shard's pairs (`retention confirm --shard`); without it, complete shards are merged first.
    """
    from protocol.splits import load_split

    cfg = dict(arm_config)
    unknown = sorted(set(cfg) - _ARM_KEYS - {"model", "budget", "samples", "seed", "max_new_tokens", "split",
                                             "plan_hash", "model_revision"})
    if unknown:
        raise RetentionError(f"plan arm configuration has unknown key(s) {unknown}; allowed: {sorted(_ARM_KEYS)}")
    if cfg.get("split") != "confirm":
        raise RetentionError("confirm_runner runs the confirm split only")
    params = dict(cfg.get("scorer_params") or {})
    sampling = {"max_new_tokens": int(cfg["max_new_tokens"]), "temperature": float(cfg.get("temperature", 0.6)),
                "top_p": float(cfg.get("top_p", 0.95)), "ignore_eos": bool(cfg.get("ignore_eos", False))}
    base = {"model": cfg["model"], "dtype": cfg.get("dtype", "float32"), "device": cfg.get("device", "cpu"),
            "budget": cfg.get("budget"), "interval": cfg.get("interval"), "accounting": cfg.get("accounting", "mean"),
            "sink": cfg.get("sink"), "recent": cfg.get("recent"), "protect_prompt": bool(cfg.get("protect_prompt", False)),
            "split": "confirm", "data": cfg.get("data"),
            "limit": cfg.get("limit"), "samples": int(cfg["samples"]), "seed": int(cfg["seed"]),
            "fidelity": bool(cfg.get("fidelity", False)), **sampling}
    if "engine" in cfg:
        base["engine"] = cfg["engine"]
    try:
        spec = validate_arm(dict(base, scorer=cfg["scorer"], scorer_params=params))
    except RetentionError as exc:  # bad input, not a crash: confirm must not log it as one
        raise ProtocolError(str(exc)) from None
    problems = load_split("confirm", data_path=base["data"], splits_dir=splits_dir)
    if base["limit"]:
        problems = problems[: int(base["limit"])]
    # A pinned model revision that differs from the loaded one shows up as a logged deviation.
    extra = {"plan_hash": cfg["plan_hash"]}
    dirs = execute(base["model"], base["dtype"], base["device"], [spec], split="confirm", data_path=base["data"],
                   limit=base["limit"], samples=base["samples"], seed=base["seed"], sampling=sampling,
                   fidelity=base["fidelity"], grade=True, out=Path(out_dir), progress=True, problems=problems,
                   extra_config=extra, shard=shard, engine=base.get("engine", "hf"))
    return dirs[0]


commands = [run_command]
