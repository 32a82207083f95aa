"""`retention confirm`: run a registered plan's cells on the confirm split and record them in the ledger.

The work is done in `protocol.prereg`, imported inside the command so that `retention --help` stays fast.
`confirm` needs a generation runner (see `protocol.prereg`'s runner contract), chosen by
`retention.runs.confirm_inputs.resolve_runner`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click

from retention.cli.options import splits_dir_option
from retention.cli.study_inputs import current_code_version, key_values, runtime_schema
from retention.errors import RetentionError


# --------------------------------------------------------------------------------------------------
# helpers


def tree_is_dirty() -> bool:
    """Whether this checkout has uncommitted changes to tracked files or untracked files under its
    package folders (False outside a git checkout:
    an installed package is whatever version it was built from)."""
    return current_code_version().endswith(".dirty")


def _dirty_tree_deviation(allow_dirty: bool) -> list[tuple[str, dict]]:
    """Refuse to confirm from a tree with uncommitted changes (the code that ran could not be named
    by a commit), or, with --allow-dirty, the deviation every confirmed cell records."""
    if not tree_is_dirty():
        return []
    if not allow_dirty:
        raise click.ClickException("the source tree has uncommitted changes: commit them (the ledger names the "
                                   "code by its commit), or pass --allow-dirty to confirm anyway as a logged "
                                   "deviation")
    return [("dirty_tree", {"code_version": current_code_version()})]


# --------------------------------------------------------------------------------------------------
# confirm


@click.command("confirm")
@click.option("--plan", "plan_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Registered plan file.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Confirm directory (ledger, deviations, runs) [default: results/confirm/plan-<hash12>].")
@click.option("--cell", "cells", multiple=True,
              help="Only these cell ids [default: every cell not yet confirmed].")
@click.option("--override", "overrides", multiple=True,
              help="KEY=VALUE change to the registered configuration (a logged deviation).")
@click.option("--reason", default=None, help="Why the overrides are needed (required with them).")
@click.option("--manifest-hash", default=None,
              help="Split manifest sha256 [default: read from the committed splits].")
@click.option("--code-version", default=None, help="Code version [default: version + git commit].")
@click.option("--config-schema", type=click.IntRange(min=1, max=1000), default=None,
              help="Configuration schema version.")
@click.option("--runner", "runner_spec", default=None, metavar="MODULE:FUNCTION",
              help="Generation runner [default: the plan's, else the built-in one]; one the plan did not "
                   "register is recorded as a deviation.")
@splits_dir_option
@click.option("--shard", "shard_text", default=None, metavar="I/N|auto",
              help="Only generate shard I of N of the cells' pairs (no ledger entry); a final run without "
                   "--shard merges the shards and confirms. auto: from Slurm or RANK/WORLD_SIZE.")
@click.option("--allow-dirty", is_flag=True,
              help="Confirm from a source tree with uncommitted changes (refused otherwise); logged as a "
                   "dirty_tree deviation of every cell.")
@click.option("--trace", is_flag=True,
              help="Record what each record's cache held in its run's trace.jsonl (as `run --trace`; not part of "
                   "the registered configuration). Built-in runner only.")
def confirm_cmd(plan_path, out, cells, overrides, reason, manifest_hash, code_version,
                config_schema, runner_spec, splits_dir, shard_text, allow_dirty, trace):
    """Run a registered plan's cells on the confirm split and record them in the ledger.

    Each cell is recorded as started in the registry before its first generation (a shard too),
    and a cell another plan confirmed or started is refused unless the plan supersedes it."""
    from protocol import prereg

    from protocol.splits import manifest_sha256

    from retention.runs import jobs
    from retention.runs.confirm_inputs import resolve_runner, validate_confirm_arm

    plan, h = prereg.load_plan(plan_path)
    override_map = key_values(overrides, "--override") or None
    out = out or Path("results") / "confirm" / f"plan-{h[:12]}"
    runner, spec = resolve_runner(runner_spec, plan)
    from retention.runs.confirm_inputs import check_runner_sources

    check_runner_sources(plan, runner_spec)  # the registered runner's code, as registered
    if runner is getattr(jobs, "confirm_runner", None):
        runner = functools.partial(runner, splits_dir=splits_dir, trace=trace)
    elif trace:
        raise RetentionError(f"--trace needs the built-in runner; {spec or plan.get('runner')} records no cache trace")
    # The split manifest these problems come from (--splits-dir's), checked against the plan's on
    # both paths: a shard generates, so it must refuse a differing manifest as the merge does.
    manifest_hash = manifest_hash or manifest_sha256(splits_dir, dataset=plan.get("dataset", "math500"))
    if shard_text is not None:
        from retention.runs.scale.confirm_shard import generate_confirm_shard
        from retention.runs.shard import parse_shard

        if spec is not None and spec != plan.get("runner", prereg.DEFAULT_RUNNER_SPEC):
            raise click.ClickException(f"--runner {spec} is not the plan's registered runner: --shard generates "
                                       "only with the registered one (a shard writes no ledger entry to record it)")
        generate_confirm_shard(plan_path, out, parse_shard(shard_text), runner=runner, cells=list(cells) or None,
                               overrides=override_map, reason=reason, manifest_hash=manifest_hash,
                               validate=validate_confirm_arm, log=click.echo)
        return
    dirty = _dirty_tree_deviation(allow_dirty)  # the shards' records are confirmed by this run
    canonical = _check_canonical_repeats(plan, h, cells)
    entries = prereg.confirm(
        plan_path, out, runner, manifest_hash=manifest_hash, deviations=dirty,
        validate=validate_confirm_arm, runner_spec=spec,
        code_version=code_version or current_code_version(),
        config_schema=runtime_schema() if config_schema is None else config_schema,
        cells=list(cells) or None, overrides=override_map, reason=reason, log=click.echo)
    _record_canonical(canonical, entries, h, out)
    click.echo(f"{len(entries)} cell(s) confirmed under plan {h[:12]}; ledger: "
               f"{prereg.ledger_path(out)}")


def _check_canonical_repeats(plan: dict, h: str, cells) -> dict[str, str]:
    """A plan registered before plans were canonical (`retention.runs.identity`) may name a cell that
    another plan confirmed under its canonical identity: refused as a repeat. Returns {cell id:
    canonical key} of the cells to confirm whose canonical identity differs from the registered one."""
    from protocol.ledger import Registry
    from protocol.plans import superseded_plans

    from retention.runs.identity import canonical_cell_keys

    keys = {c: k for c, k in canonical_cell_keys(plan).items() if not cells or c in cells}
    registry = Registry()
    for cid, key in keys.items():
        others = [a for a in registry.cell_attempts(key) if a["plan_hash"] != h]
        covered = superseded_plans(plan, others)
        done = [a for a in others if a["status"] == "confirmed" and a["plan_hash"] not in covered]
        if done:
            raise click.ClickException(f"cell {cid} was already confirmed under plan {done[-1]['plan_hash'][:12]} "
                                       f"(in {done[-1]['out_dir']}), spelled differently: one confirmation per cell")
    return keys


def _record_canonical(keys: dict[str, str], entries: list[dict], h: str, out: Path) -> None:
    """Record the confirmed cells of a plan registered before plans were canonical under their canonical
    identity too, so that a canonical plan of the same cell is refused."""
    from protocol.ledger import Registry

    registry = Registry()
    for entry in entries:
        key = keys.get(entry.get("cell_id"))
        if key is not None:
            registry.record_attempt(key, plan_hash=h, cell_id=entry["cell_id"], status="confirmed",
                                    out_dir=str(Path(out).resolve()))


commands = [confirm_cmd]
