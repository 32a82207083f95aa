"""`retention run`: generate under one or several retention policies on the dev split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from retention.errors import RetentionError


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
    cadence = cadence_for(scorer_obj, base["budget"], base["interval"], base["accounting"], base["sink"], base["recent"])
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
              help="Model alias (r1-distill-qwen-7b, r1-distill-llama-8b, smollm2-135m, tiny-random) or a local folder.")
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
@click.option("--lambda", "lam", type=float, default=None, help="alpha/rkv: redundancy weight lambda (defaults: alpha 0.5, rkv 0.1); applies to every listed scorer that takes it.")
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
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run_command(model, scorers, baseline, budget, budget_kib, interval, accounting, sink, recent, lam, radius, window, routing,
                stats_path, split, data_path, limit, samples, max_new_tokens, temperature, top_p, seed, ignore_eos,
                fidelity, no_grade, dtype, device, out, quiet):
    """Generate on the dev split under retention policies and write resumable run directories.

    Rerunning the same command resumes: finished records are skipped.
    """
    if split == "confirm":
        raise RetentionError("the confirm split is reachable only through a pre-registered plan: "
                             "`retention preregister` then `retention confirm --plan PLAN.json`")
    if temperature < 0 or not (0 < top_p <= 1):
        raise RetentionError("--temperature must be >= 0 and --top-p in (0, 1]")
    if lam is not None and lam < 0:
        raise RetentionError(f"--lambda must be >= 0, got {lam}")
    names = _scorer_list(scorers)
    if baseline and baseline not in names:
        names.append(baseline)
    budget = _layout_budget(model, dtype, names, budget, budget_kib)
    sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "ignore_eos": ignore_eos}
    options = {"lam": lam, "radius": radius, "window": window, "routing": routing, "stats": stats_path}
    base = {"model": model, "dtype": dtype, "device": device, "budget": budget, "interval": interval,
            "accounting": accounting, "sink": sink, "recent": recent, "split": split, "data": data_path,
            "limit": limit, "samples": samples, "seed": seed, "fidelity": fidelity, **sampling}
    if budget_kib is not None:
        base["budget_kib"] = budget_kib
    # Validate every arm before loading a model or touching the output folder.
    arm_specs = [(name, *build_arm_config(base, name, options)) for name in names]
    run_dirs = execute(model, dtype, device, arm_specs, split=split, data_path=data_path, limit=limit,
                       samples=samples, seed=seed, sampling=sampling, fidelity=fidelity, grade=not no_grade,
                       out=Path(out), progress=not quiet)
    for d in run_dirs:
        click.echo(_summary_line(d))


def _layout_budget(model: str, dtype: str, names: list[str], budget: int | None, budget_kib: float | None) -> int | None:
    """The token budget (from --budget-bytes through the model's cache layout), after refusing
    scorers the layout does not support."""
    from retention.arch.retention import check_run_scorers
    from retention.layouts import tokens_for_bytes
    from retention.models import model_layout

    layout = model_layout(model, dtype)
    check_run_scorers(layout, names)
    if budget_kib is None:
        return budget
    if budget is not None:
        raise RetentionError("give --budget (tokens) or --budget-bytes (KiB), not both")
    if budget_kib <= 0:
        raise RetentionError(f"--budget-bytes must be a positive number of KiB, got {budget_kib:g}")
    return tokens_for_bytes(layout, budget_kib * 1024)


def execute(model, dtype, device, arm_specs, *, split, data_path, limit, samples, seed, sampling, fidelity, grade,
            out: Path, progress=True, problems=None, extra_config=None):
    """Load the model and problems, open one run directory per arm, generate. Returns the run dirs."""
    from protocol.splits import load_split
    from retention.models import load_model
    from retention.runner import Arm, open_run, run_arms

    if problems is None:
        problems = load_split(split, data_path=data_path)
        if limit:
            problems = problems[:limit]
    loaded = load_model(model, dtype=dtype, device=device)
    arms = []
    for name, config, params, cadence in arm_specs:
        config = dict(config, model_id=loaded.model_id, model_revision=loaded.revision, **(extra_config or {}))
        arms.append(Arm(open_run(out, config), name, params, cadence))
    run_arms(loaded, arms, problems, samples=samples, base_seed=seed, sampling=sampling, fidelity=fidelity,
             grade=grade, progress=progress)
    return [a.run.path for a in arms]


def _summary_line(run_dir: Path) -> str:
    recs = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]
    n = len(recs)
    correct = sum(1 for r in recs if r.get("verdict") is True)
    mean_cache = sum(r["cache_mean_tokens"] for r in recs) / n if n else 0.0
    tps = sum(r["tokens_per_second"] for r in recs) / n if n else 0.0
    over = sum(1 for r in recs if r["budget_exceeded"])
    return (f"{run_dir}: {n} records, accuracy {correct}/{n}, mean cache {mean_cache:.1f} tokens, "
            f"{tps:.1f} tok/s, budget exceeded in {over}")


# Keys a pre-registered arm configuration may set (the rest come from the plan: model, budget,
# samples, seed, max_new_tokens, split). Names are those of the run configuration (docs/records.md)
# so that `confirm` can compare what was planned with what ran, key by key.
_ARM_KEYS = {"scorer", "scorer_params", "stats_sha256", "interval", "accounting", "sink", "recent", "temperature", "top_p",
             "dtype", "device", "data", "limit", "fidelity", "ignore_eos"}


def validate_arm_config(name: str, cfg: dict) -> None:
    """Refuse, at registration, an arm configuration the runner could not run as written."""
    import dataclasses as dc

    from retention.scorers import get_scorer_class

    if not cfg.get("scorer"):
        raise RetentionError(f"the {name} configuration needs a 'scorer'")
    unknown = sorted(set(cfg) - _ARM_KEYS)
    if unknown:
        raise RetentionError(f"{name} configuration has unknown key(s) {unknown}; allowed: {sorted(_ARM_KEYS)}")
    cls = get_scorer_class(cfg["scorer"])
    fields = {f.name for f in dc.fields(cls)} - {"seed"}
    bad = sorted(set(cfg.get("scorer_params") or {}) - fields)
    if bad:
        raise RetentionError(f"{name} scorer {cfg['scorer']!r} has no parameter(s) {bad}; "
                             f"it takes {sorted(f for f in fields if not f.startswith('_'))}")


def confirm_runner(cell: dict, arm: str, arm_config: dict, out_dir: Path) -> Path:
    """The generation runner of `retention confirm` (contract in `protocol.prereg`).

    Runs one arm of one registered cell on the confirm split through the same code as
    `retention run`, resuming an interrupted run; returns its run directory.
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
            "sink": cfg.get("sink"), "recent": cfg.get("recent"), "split": "confirm", "data": cfg.get("data"),
            "limit": cfg.get("limit"), "samples": int(cfg["samples"]), "seed": int(cfg["seed"]),
            "fidelity": bool(cfg.get("fidelity", False)), **sampling}
    spec = (cfg["scorer"], *build_arm_config(base, cfg["scorer"], params))
    problems = load_split("confirm", data_path=base["data"])
    if base["limit"]:
        problems = problems[: int(base["limit"])]
    # A pinned model revision that differs from the loaded one shows up as a logged deviation.
    extra = {"plan_hash": cfg["plan_hash"]}
    dirs = execute(base["model"], base["dtype"], base["device"], [spec], split="confirm", data_path=base["data"],
                   limit=base["limit"], samples=base["samples"], seed=base["seed"], sampling=sampling,
                   fidelity=base["fidelity"], grade=True, out=Path(out_dir), progress=True, problems=problems,
                   extra_config=extra)
    return dirs[0]


commands = [run_command]
