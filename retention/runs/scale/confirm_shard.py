"""`retention confirm --plan P --shard I/N`: one shard of a confirmation, generated only.

A confirmation cut into shards runs in two steps. First every shard generates its pairs of both
arms of every cell not yet confirmed (`--shard I/N` or `auto`, one process per GPU or Slurm task),
writing no ledger entry: a shard is not a result. It is an attempt, though: each cell a shard
touches is recorded at once as "started" in the registry's cell file, so a confirmation abandoned
after its shards stays visible. Then one plain `retention confirm --plan P` finds the shards complete
in the cell's run directories, merges them in place (refusing missing, duplicated or inconsistent
shards) and confirms each cell once, as an unsharded confirmation does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path

from protocol import prereg
from protocol.confirmation import check_overrides
from protocol.ledger import Registry
from retention.errors import RetentionError
from retention.runs.jobs import confirm_runner


def generate_confirm_shard(plan_path: Path, out: Path, shard, *, runner=None, cells=None,
                           overrides: dict | None = None,
                           reason: str | None = None, manifest_hash: str | None = None,
                           validate: Callable[[dict], None] | None = None, registry=None,
                           log: Callable[[str], None] = print) -> list[Path]:
    """Generate shard `shard` of the plan's open cells into `out/runs/<cell>/`; returns the run dirs.

    runner: the plan's registered runner (default: the built-in `retention.runs.jobs.confirm_runner`); it
    must take a `shard` keyword, with which it only generates that shard's pairs (the runner contract
    of `protocol.prereg`); validate: called with every arm configuration before anything is written
    (input errors); registry: the user-level registry (default: `protocol.ledger.Registry()`)."""
    plan, h = prereg.load_plan(Path(plan_path))
    current = manifest_hash or prereg._current_manifest_hash(plan.get("dataset", "math500"))
    if current != plan["split_manifest_sha256"]:
        raise RetentionError(f"split manifest {current[:12]} differs from the registered "
                             f"{plan['split_manifest_sha256'][:12]}: refusing to generate")
    runner = runner or confirm_runner
    if not _takes_shard(runner):
        raise RetentionError(f"the runner {plan.get('runner', prereg.DEFAULT_RUNNER_SPEC)} of plan {h[:12]} takes no "
                             "`shard` keyword, so it cannot generate shards: run confirm without --shard")
    check_overrides(overrides, reason)
    registry = registry or Registry()
    done = set()
    if registry.key(h) is not None:
        done = {e["cell_id"] for e in registry.ledger(h).entries() if e.get("kind") == "cell"}
    if prereg.ledger_path(out).is_file():
        done |= {c["cell_id"] for c in prereg.read_confirmation(out, registry)["cells"]}
    by_id = {c["id"]: c for c in plan["cells"]}
    wanted = list(dict.fromkeys(cells)) if cells else [c for c in by_id if c not in done]
    unknown = [c for c in wanted if c not in by_id]
    if unknown:
        raise RetentionError(f"cell(s) {unknown} are not in plan {h[:12]}")
    again = [c for c in wanted if c in done]
    if again or not wanted:
        raise RetentionError(f"cell(s) {again or sorted(done)} of plan {h[:12]} are already confirmed")
    configs = {(c, arm): prereg.arm_config(plan, h, by_id[c], arm, overrides) for c in wanted for arm in prereg.ARMS}
    for cfg in configs.values() if validate is not None else ():
        validate(cfg)  # before anything is written: an input error is never a crash
    repeats = prereg.check_repeats(plan, h, registry, wanted)
    out_id = str(Path(out).resolve())
    sup_reason = (plan.get("supersedes") or {}).get("reason")
    dirs = []
    for cid in wanted:
        key, superseded = repeats[cid]
        registry.record_attempt(key, plan_hash=h, cell_id=cid, status="started", out_dir=out_id,
                                supersedes=superseded, reason=sup_reason if superseded else None)
        for arm in prereg.ARMS:
            cfg = configs[(cid, arm)]
            log(f"{cid}: shard {shard} of {arm} ({cfg.get('scorer')})")
            dirs.append(Path(runner(dict(by_id[cid]), arm, cfg, Path(out) / "runs" / cid, shard=shard)))
    log(f"shard {shard} of {len(wanted)} cell(s) generated; when every shard is done, run "
        f"`retention confirm --plan {plan_path} --out {out}` to merge and confirm")
    return dirs


def _takes_shard(runner) -> bool:
    """Whether `runner` accepts a `shard` keyword (named, or through **kwargs)."""
    target = runner.func if isinstance(runner, functools.partial) else runner
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "shard" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
