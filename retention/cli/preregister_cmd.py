"""`retention preregister`: write a content-hashed pre-registration plan.

The work is done in `protocol.prereg`, imported inside the command so that `retention --help` stays fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import click

from retention.cli.options import bounded, collect, splits_dir_option
from retention.cli.study_inputs import current_code_version, key_values, runtime_schema
from retention.runtime.sampling import DEFAULT_SAMPLER, SAMPLERS


# --------------------------------------------------------------------------------------------------
# helpers


def _arm_config(text: str | None, sets, what: str) -> dict:
    """An arm configuration from JSON (inline or @file) plus dotted KEY=VALUE settings."""
    cfg = {}
    if text:
        raw = Path(text[1:]).read_text(encoding="utf-8") if text.startswith("@") else text
        try:
            cfg = json.loads(raw)
        except ValueError as exc:
            raise click.ClickException(f"{what}: not JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise click.ClickException(f"{what}: must be a JSON object")
    for key, value in key_values(sets, what + "-set").items():
        node = cfg
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return cfg


def _with_sampler(cfg: dict, sampler: str) -> dict:
    """`cfg` with `sampler` unless it sets its own or runs on vLLM (which samples its own way);
    `normalize_arm` drops it from a greedy arm."""
    if "sampler" in cfg or cfg.get("engine", "hf") != "hf":
        return cfg
    return dict(cfg, sampler=sampler)


def _budget(text: str):
    if text.lower() in ("full", "none"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise click.ClickException(f"--budget: {text!r} is not an integer or 'full'") from None
    if value <= 0:
        raise click.ClickException(f"--budget: budget must be > 0, got {value}")
    return value


# --------------------------------------------------------------------------------------------------
# preregister


@dataclass(frozen=True)
class PlanArms:
    """The plan's two arm configurations, each from JSON (inline or @file) plus dotted KEY=VALUE
    settings, with --sampler where the arm sets none, normalised (`retention.runs.arms.normalize_arm`)."""

    treatment: dict
    baseline: dict

    @classmethod
    def from_options(cls, *, treatment, treatment_set, baseline, baseline_set, sampler) -> PlanArms:
        from retention.policy.registry import new_run_config
        from retention.runs.arms import normalize_arm

        # A new plan's arms get the parameters new runs get where they name none (`quant.store` packed).
        return cls(*(normalize_arm(new_run_config(_with_sampler(_arm_config(text, sets, flag), sampler)))
                     for text, sets, flag in ((treatment, treatment_set, "--treatment"),
                                              (baseline, baseline_set, "--baseline"))))


@dataclass(frozen=True)
class PlanTest:
    """The primary test a plan registers: its name, bootstrap resamples (more near the threshold),
    resampling seed, family-wise alpha and Bonferroni family size (None: the number of cells)."""

    test: str
    boot: int
    boot_max: int
    boot_seed: int
    alpha: float
    m: int | None


@dataclass(frozen=True)
class PowerChoice:
    """How each cell's power is computed and bounded (`retention.runs.power_inputs.with_power`)."""

    dev_paths: tuple[Path, ...]
    target_power: float
    mde_bound: float
    allow_underpowered: bool
    time_slots: int | None


@dataclass(frozen=True)
class Provenance:
    """What a plan names its inputs by: the split manifest, the code version, the configuration
    schema, pinned model revisions and the generation runner (None: the defaults)."""

    manifest_hash: str | None
    code_version: str | None
    config_schema: int | None
    model_revision: tuple[str, ...]
    runner_spec: str | None


@dataclass(frozen=True)
class Supersedes:
    """Plans whose cells this one confirms again, and why (`--supersedes`, `--reason`)."""

    supersedes: tuple[str, ...]
    reason: str | None


@click.command("preregister")
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Plan file (*.json), or a directory to write plan-<hash12>.json into.")
@click.option("--model", "models", multiple=True, required=True, help="Model of the cells (repeat).")
@click.option("--budget", "budgets", multiple=True, required=True,
              help="Budget of the cells: tokens or 'full' (repeat).")
@click.option("--treatment", default=None, help="Treatment configuration: JSON or @file.json.")
@click.option("--treatment-set", multiple=True,
              help="Treatment KEY=VALUE (dotted keys nest: scorer_params.lambda=0.5).")
@click.option("--baseline", default=None, help="Baseline configuration: JSON or @file.json.")
@click.option("--baseline-set", multiple=True, help="Baseline KEY=VALUE (dotted keys nest).")
@click.option("-k", "--samples", type=click.IntRange(min=1, max=10_000), required=True,
              help="Generations per problem and arm.")
@click.option("--seed", type=click.IntRange(min=0, max=2**63 - 1), default=0, show_default=True,
              help="Sampling seed of the runs.")
@click.option("--max-new-tokens", type=click.IntRange(min=1, max=1 << 20), required=True,
              help="Generation token limit.")
@click.option("--test", type=click.Choice(["cluster-bootstrap"]), default="cluster-bootstrap",
              show_default=True, help="Primary test.")
@click.option("--boot", type=click.IntRange(min=1, max=10_000_000), default=100_000, show_default=True,
              help="Bootstrap resamples.")
@click.option("--boot-max", type=click.IntRange(min=1, max=10_000_000), default=1_000_000, show_default=True,
              help="Resamples when p is near the threshold.")
@click.option("--boot-seed", type=click.IntRange(min=0, max=2**32 - 1), default=0, show_default=True,
              help="Resampling seed.")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.05,
              show_default=True, help="Family-wise significance level.")
@click.option("--m", "--cells", "m", type=click.IntRange(min=1, max=1_000_000), default=None,
              help="Bonferroni family size [default: number of cells].")
@click.option("--model-revision", multiple=True, help="MODEL=REVISION pin (repeat).")
@click.option("--manifest-hash", default=None,
              help="Split manifest sha256 [default: read from the committed splits].")
@click.option("--code-version", default=None, help="Code version [default: version + git commit].")
@click.option("--config-schema", type=click.IntRange(min=1, max=1000), default=None,
              help="Configuration schema version.")
@click.option("--sampler", type=click.Choice(SAMPLERS), default=DEFAULT_SAMPLER, show_default=True,
              help="The sampler of each sampled arm that does not set `sampler` itself (`retention run --sampler`).")
@click.option("--note", default=None, help="Free text stored in the plan.")
@click.option("--dataset", type=click.Choice(["math500", "aime24", "aime25"]), default="math500", show_default=True,
              help="Dataset whose confirm set the plan uses (stored in the plan unless math500).")
@click.option("--runner", "runner_spec", default=None, metavar="MODULE:FUNCTION",
              help="Register a generation runner for confirm [default: the built-in one].")
@click.option("--supersedes", multiple=True, metavar="PLAN_HASH",
              help="A plan that already confirmed (or started) a cell of this one; needs --reason (repeat).")
@click.option("--reason", default=None, help="Why the cells are confirmed again (with --supersedes).")
@click.option("--dev", "dev_paths", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Dev runs (run directories or folders of them; repeat): each cell's power comes from the dev runs "
                   "of its model and budget whose arms are the plan's treatment and baseline (docs/power.md).")
@click.option("--power", "target_power", type=float, default=0.8, callback=bounded("--power", 0, 0.999, lo_open=True),
              show_default=True, help="Power at which each cell's minimum detectable effect (MDE) is computed.")
@click.option("--mde-bound", type=float, default=10.0, callback=bounded("--mde-bound", 0, 100, lo_open=True),
              show_default=True,
              help="Largest MDE (percentage points) a cell may have; a plan above it is refused without "
                   "--allow-underpowered.")
@click.option("--allow-underpowered", is_flag=True,
              help="Register a plan whose MDE is above --mde-bound (recorded in the plan).")
@click.option("--time-slots", type=click.IntRange(min=1, max=4096), default=None,
              help="Measure this host's decode step (each model loaded, a few steps of a dev problem at 1 and this "
                   "many slots) and record the predicted wall time of the confirmation.")
@splits_dir_option
@collect("provenance", Provenance)
@collect("arms", PlanArms.from_options, ("treatment", "treatment_set", "baseline", "baseline_set", "sampler"))
@collect("test", PlanTest)
@collect("power", PowerChoice)
@collect("supersede", Supersedes)
def preregister_cmd(out, models, budgets, samples, seed, max_new_tokens, note, dataset, splits_dir,
                    arms: PlanArms, test: PlanTest, power: PowerChoice, provenance: Provenance,
                    supersede: Supersedes):
    """Write a content-hashed pre-registration plan for a confirm run.

    A plan whose cells another plan already confirmed or started (same model, budget, dataset and
    arms; seed, note, k and test do not count) is refused unless it names that plan with
    --supersedes and a --reason, both recorded in the plan."""
    from protocol import prereg
    from protocol.splits import manifest_sha256

    from retention.runs.arms import validate_plan

    manifest_hash = provenance.manifest_hash
    if manifest_hash is not None and not re.fullmatch(r"[0-9a-f]{64}", manifest_hash):
        raise click.ClickException(f"--manifest-hash must be 64 lowercase hex digits, got {manifest_hash!r}")
    # verifies the splits against the data; each dataset has its own manifest
    manifest = manifest_sha256(splits_dir, dataset=dataset or "math500")
    if manifest_hash is not None and manifest_hash != manifest:
        raise click.ClickException(f"--manifest-hash {manifest_hash[:12]} is not the verified split manifest "
                                   f"{manifest[:12]}; a plan must name the splits it will be confirmed on")
    sources = None
    runner_spec = provenance.runner_spec
    if runner_spec is not None:
        from retention.runs.confirm_inputs import runner_sources

        sources = runner_sources(runner_spec)  # loads it: a runner that cannot run is refused now, not at confirm
    from retention.runs.identity import canonical_plan

    # Models by content and arms fully resolved: two spellings of one cell are one cell.
    plan = canonical_plan(
        models=models, budgets=[_budget(b) for b in budgets],
        treatment=arms.treatment, baseline=arms.baseline, k=samples, seed=seed,
        max_new_tokens=max_new_tokens, manifest_hash=manifest,
        code_version=provenance.code_version or current_code_version(), boot=test.boot, boot_max=test.boot_max,
        boot_seed=test.boot_seed, alpha=test.alpha, m=test.m, test=test.test,
        config_schema=runtime_schema() if provenance.config_schema is None else provenance.config_schema,
        model_revisions={k: str(v) for k, v in key_values(provenance.model_revision, "--model-revision").items()},
        note=note, dataset=dataset, runner=runner_spec, runner_sources=sources, supersedes=supersede.supersedes,
        reason=supersede.reason)
    # Each arm of each cell exactly as `run` would validate it; the calibration statistics each
    # resolves to are recorded by content, per cell (each model has its own).
    plan = prereg.with_cell_stats(plan, validate_plan(plan))
    from retention.runs.smoke import check_plan_runs

    check_plan_runs(plan)  # built as confirm builds it; a plugin through its cheap checks on tiny-random
    from retention.runs.power_inputs import with_power

    plan, refused = with_power(plan, power.dev_paths, power.target_power, power.mde_bound, power.allow_underpowered,
                               power.time_slots, splits_dir)
    if refused:
        mdes = ", ".join("undefined" if plan["power"]["cells"][c]["mde_pp"] is None
                         else f"{plan['power']['cells'][c]['mde_pp']:.1f}" for c in refused)
        raise click.ClickException(
            f"cell(s) {', '.join(refused)} cannot detect less than {power.mde_bound:g} pp at power "
            f"{power.target_power:g} "
            f"(MDE {mdes} pp); raise k or the bound, or register anyway with --allow-underpowered")
    path, h, written = prereg.write_plan(plan, out)  # refuses an unacknowledged repeat of a cell
    state = "registered" if written else "already registered (unchanged)"
    click.echo(f"plan {h[:12]} {state}: {path}")
    if plan.get("supersedes"):
        click.echo(f"  supersedes {', '.join(p[:12] for p in plan['supersedes']['plans'])}: "
                   f"{plan['supersedes']['reason']}")
    click.echo(f"  {len(plan['cells'])} cell(s): {', '.join(c['id'] for c in plan['cells'])}; "
               f"k={plan['k']}, B={plan['test']['boot']}, alpha={plan['test']['alpha']}, "
               f"m={plan['test']['m']}")
    from protocol.power import power_lines

    for line in power_lines(plan):
        click.echo(line)
    click.echo(f"  sha256 {h}")


commands = [preregister_cmd]
