"""Jobs: load a model and problems, open one run directory per arm, generate; and the runner that
`retention confirm` plugs into the protocol. The CLI parses and prints; this module does the work."""

from __future__ import annotations

from pathlib import Path

from protocol.errors import ProtocolError
from protocol.exploration import record_exploration
from retention.errors import RetentionError
from retention.models import load_model
from retention.models.arch.deepseek import on_reference_mla
from retention.runs.arms import _ARM_KEYS, validate_arm
from retention.runs.engine_runs import execute_with_engine
from retention.runs.merge import open_shard_run
from retention.runs.runner import Arm, run_arms
from retention.runs.settings import Budget, Output, RunSettings
from retention.policy.registry import FAMILIES


def execute(settings: RunSettings, arm_specs, *, problems=None, extra_config=None, shard=None) -> list[Path]:
    """Load the model and problems, open one run directory per arm, generate. Returns the run dirs.

    settings: the run's `RunSettings` (model, dtype, device, engine, problems, sampling, output);
    arm_specs: the validated `ArmSpec`s, built with those settings. problems: the problems to decode
    (None: the settings' own, `Problems.load`); extra_config: keys added to every arm's configuration
    (a plan's hash); shard: a `retention.runs.shard.Shard` to generate only its pairs (None: all).
    The engine: "hf" (this project's `retention.runtime.engine`: a DeepSeek-V2/V3 checkpoint always
    decodes there on the reference MLA, `retention.models.arch.deepseek`) or an external engine of
    `retention.runs.engines` (non-evicting arms only). The output's batch_size (the static step's slot
    count; None: chosen for the device's memory and the budget, printed) is not part of the
    configuration hash; the run directory and each record note it, and a run resumes at its recorded
    count (`retention.runs.slots`). A dev run of an AIME set, which has no dev split, explores its
    whole set, and that is recorded in the exploration registry (`protocol.exploration`). The model's
    prompt style goes into each configuration as `prompt` unless it is "chat". The output's trace
    (`--trace`, docs/records.md) is not part of the configuration hash, noted in config.json, and a
    run directory resumes only with its own setting."""
    if problems is None:
        problems = settings.problems.load()
    out = settings.output.out
    if settings.engine != "hf":
        if settings.problems.explores:
            _record_exploration(settings.problems.dataset, problems, [])
        return execute_with_engine(settings, arm_specs, problems, extra_config=extra_config, shard=shard)
    loaded = on_reference_mla(load_model(settings.model, dtype=settings.dtype, device=settings.device))
    arms = []
    before = set(Path(out).iterdir()) if Path(out).is_dir() else set()
    try:
        for spec in arm_specs:
            prompt = {} if loaded.prompt == "chat" else {"prompt": loaded.prompt}
            # Absent for a model that is not a GGUF file: those configurations keep their hash.
            quant = {} if loaded.quant is None else {"model_quant": loaded.quant}
            spec = spec.with_config(model_id=loaded.model_id, model_revision=loaded.revision, **prompt, **quant,
                                    **(extra_config or {}))
            arms.append(Arm(open_shard_run(out, spec.config, shard, trace=settings.output.trace), spec))
    except RetentionError:  # a refused arm: the directories this command created for the others go too
        for arm in arms:
            arm.run.close()
            if arm.run.path not in before:
                remove_empty_run(arm.run.path)
        raise
    if settings.problems.explores:
        _record_exploration(settings.problems.dataset, problems, [a.run.hash for a in arms])
    try:
        run_arms(loaded, arms, problems, settings, shard=shard)
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
    try:  # bad input, not a crash: confirm must not log it as one
        settings = RunSettings.from_plan(cfg, Output(Path(out_dir), trace=trace), splits_dir)
        arm = dict(scorer=cfg["scorer"], scorer_params=dict(cfg.get("scorer_params") or {}),
                   **{f: cfg[f] for f in FAMILIES if f in cfg})
        spec = validate_arm(arm, settings=settings, budget=Budget.from_config(cfg))
    except RetentionError as exc:
        raise ProtocolError(str(exc)) from None
    # A pinned model revision that differs from the loaded one shows up as a logged deviation.
    dirs = execute(settings, [spec], extra_config={"plan_hash": cfg["plan_hash"]}, shard=shard)
    return dirs[0]
