"""Jobs: load a model and problems, open one run directory per arm, generate; and the runner that
`retention confirm` plugs into the protocol. The CLI parses and prints; this module does the work."""

from __future__ import annotations

from pathlib import Path

from protocol.errors import ProtocolError
from protocol.exploration import record_exploration
from protocol.splits import load_split, run_problems
from retention.errors import RetentionError
from retention.models import load_model, model_layout
from retention.models.arch.deepseek import on_reference_mla
from retention.models.layouts import tokens_for_bytes
from retention.runs.arms import MAX_BUDGET, _ARM_KEYS, validate_arm
from retention.runs.engine_runs import execute_with_engine
from retention.runs.runner import Arm, run_arms
from retention.runs.merge import open_shard_run
from retention.policy.registry import FAMILIES


def budget_from_bytes(model: str, dtype: str, budget: int | None, budget_kib: float | None) -> int | None:
    """The token budget: --budget, or --budget-bytes converted through the model's cache layout."""
    if budget_kib is None:
        return budget
    if budget is not None:
        raise RetentionError("give --budget (tokens) or --budget-bytes (KiB), not both")
    if not (0 < budget_kib < float("inf")):
        raise RetentionError(f"--budget-bytes must be a positive number of KiB, got {budget_kib:g}")
    layout = model_layout(model, dtype)
    if budget_kib * 1024 / layout.bytes_per_token > MAX_BUDGET:  # checked in floats: 1e308 KiB is no integer
        raise RetentionError(f"--budget-bytes {budget_kib:g} KiB holds more than {MAX_BUDGET:,} tokens of {model}'s "
                             "cache; give a budget a run can use")
    return tokens_for_bytes(layout, budget_kib * 1024)


def execute(model, dtype, device, arm_specs, *, split, data_path, limit, samples, seed, sampling, fidelity, grade,
            out: Path, progress=True, problems=None, extra_config=None, shard=None, batch_size=None,
            splits_dir=None, engine="hf", dataset="math500", trace=False):
    """Load the model and problems, open one run directory per arm, generate. Returns the run dirs.

    shard: a `retention.runs.scale.shard.Shard` to generate only its pairs (None: all); engine: "hf" (this
    project's `retention.runtime.engine`: a DeepSeek-V2/V3 checkpoint always decodes there on the reference
    MLA, `retention.models.arch.deepseek`) or an external engine of `retention.runs.engines` (non-evicting arms only).
    batch_size: sequences decoded together (the static step's slot count); None chooses one for the
    device's memory and the budget (printed). It is not part of the configuration hash; the run
    directory and each record note it, and a run resumes at its recorded count (`retention.runs.slots`).
    dataset: math500 (dev or confirm split) or an AIME set, which has no dev split: a dev run explores
    its whole set, and that is recorded in the exploration registry (`protocol.exploration`).
    The model's prompt style goes into each configuration as `prompt` unless it is "chat".
    trace: record what each sequence's cache held (`--trace`, docs/records.md); not part of the
    configuration hash, noted in config.json, and a run directory resumes only with its own setting."""
    if problems is None:
        problems = run_problems(split, dataset, data_path=data_path, splits_dir=splits_dir)
        if limit:
            problems = problems[:limit]
    explores = split == "dev" and dataset != "math500"  # an AIME set has no dev split: this explores it
    if engine != "hf":
        if trace:
            raise RetentionError(f"--trace records this project's cache and needs --engine hf, not {engine}")

        if explores:
            _record_exploration(dataset, problems, [])
        return execute_with_engine(engine, model, dtype, device, arm_specs, problems, samples=samples, seed=seed,
                                   sampling=sampling, fidelity=fidelity, grade=grade, out=out, progress=progress,
                                   extra_config=extra_config, shard=shard)
    loaded = on_reference_mla(load_model(model, dtype=dtype, device=device))
    arms = []
    before = set(Path(out).iterdir()) if Path(out).is_dir() else set()
    try:
        for spec in arm_specs:
            prompt = {} if loaded.prompt == "chat" else {"prompt": loaded.prompt}
            # Absent for a model that is not a GGUF file: those configurations keep their hash.
            quant = {} if loaded.quant is None else {"model_quant": loaded.quant}
            spec = spec.with_config(model_id=loaded.model_id, model_revision=loaded.revision, **prompt, **quant,
                                    **(extra_config or {}))
            arms.append(Arm(open_shard_run(out, spec.config, shard, trace=trace), spec))
    except RetentionError:  # a refused arm: the directories this command created for the others go too
        for arm in arms:
            arm.run.close()
            if arm.run.path not in before:
                remove_empty_run(arm.run.path)
        raise
    if explores:
        _record_exploration(dataset, problems, [a.run.hash for a in arms])
    try:
        run_arms(loaded, arms, problems, samples=samples, base_seed=seed, sampling=sampling, fidelity=fidelity,
                 grade=grade, progress=progress, shard=shard, batch_size=batch_size, trace=trace)
    finally:  # however the run ends (a refused slot count included), its directories are free again
        for arm in arms:
            arm.run.close()
    return [a.run.path for a in arms]


def remove_empty_run(path: Path) -> None:
    """Remove a run directory this command created and wrote no record into (its configuration, lock
    and empty record or trace files only); anything else in it is kept."""
    disposable = {"config.json", ".lock"}
    files = list(path.iterdir()) if path.is_dir() else []
    if all(f.is_file() and (f.name in disposable or f.stat().st_size == 0) for f in files):
        for f in files:
            f.unlink()
        path.rmdir()


def _record_exploration(dataset: str, problems, config_hashes: list[str]) -> None:
    """Remember that these problems of `dataset`'s confirm set were explored (before decoding: a
    run stopped halfway has seen its problems too)."""
    record_exploration(dataset, [p.unique_id for p in problems], config_hashes)


def confirm_runner(cell: dict, arm: str, arm_config: dict, out_dir: Path, *, splits_dir=None, shard=None,
                   trace: bool = False) -> Path:
    """The generation runner of `retention confirm` (contract in `protocol.prereg`).

    Runs one arm of one registered cell on the confirm split through the same code as
    `retention run`, resuming an interrupted run; returns its run directory. shard: only that
    shard's pairs (`retention confirm --shard`); without it, complete shards are merged first.
    trace: `retention confirm --trace` (not part of the registered configuration).
    """
    cfg = dict(arm_config)
    unknown = sorted(set(cfg) - _ARM_KEYS - {"model", "budget", "samples", "seed", "max_new_tokens", "split",
                                             "plan_hash", "model_revision", "prompt"})
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
    for key in ("engine", "sampler", "protect_prompt_counted"):  # absent: the default engine, the legacy sampler
        if key in cfg:
            base[key] = cfg[key]
    dataset = cfg.get("dataset", "math500")
    if dataset != "math500":
        base["dataset"] = dataset
    try:
        spec = validate_arm(dict(base, scorer=cfg["scorer"], scorer_params=params,
                                 **{f: cfg[f] for f in FAMILIES if f in cfg}))
    except RetentionError as exc:  # bad input, not a crash: confirm must not log it as one
        raise ProtocolError(str(exc)) from None
    problems = load_split("confirm", data_path=base["data"], splits_dir=splits_dir, dataset=dataset)
    if base["limit"]:
        problems = problems[: int(base["limit"])]
    # A pinned model revision that differs from the loaded one shows up as a logged deviation.
    extra = {"plan_hash": cfg["plan_hash"]}
    dirs = execute(base["model"], base["dtype"], base["device"], [spec], split="confirm", data_path=base["data"],
                   limit=base["limit"], samples=base["samples"], seed=base["seed"], sampling=sampling,
                   fidelity=base["fidelity"], grade=True, out=Path(out_dir), progress=True, problems=problems,
                   extra_config=extra, shard=shard, engine=base.get("engine", "hf"), dataset=dataset, trace=trace)
    return dirs[0]

