"""`retention confirm --plan P --shard I/N`: one shard of a confirmation, generated only.

A confirmation cut into shards runs in two steps. First every shard generates its pairs of both
arms of every cell not yet confirmed (`--shard I/N` or `auto`, one process per GPU or Slurm task),
writing no ledger entry: a shard is not a result. Then one plain `retention confirm --plan P`
finds the shards complete in the cell's run directories, merges them in place (refusing missing,
duplicated or inconsistent shards) and confirms each cell once, as an unsharded confirmation does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from retention.errors import RetentionError


def generate_confirm_shard(plan_path: Path, out: Path, shard, *, cells=None, overrides: dict | None = None,
                           reason: str | None = None, manifest_hash: str | None = None,
                           log: Callable[[str], None] = print) -> list[Path]:
    from protocol import prereg
    from retention.jobs import confirm_runner

    plan, h = prereg.load_plan(Path(plan_path))
    current = manifest_hash or prereg._current_manifest_hash()
    if current != plan["split_manifest_sha256"]:
        raise RetentionError(f"split manifest {current[:12]} differs from the registered "
                             f"{plan['split_manifest_sha256'][:12]}: refusing to generate")
    if overrides and not reason:
        raise RetentionError("overriding the registered configuration needs a reason (deviation log)")
    done = set()
    if prereg.ledger_path(out).is_file():
        done = {c["cell_id"] for c in prereg.read_confirmation(out)["cells"]}
    by_id = {c["id"]: c for c in plan["cells"]}
    wanted = list(dict.fromkeys(cells)) if cells else [c for c in by_id if c not in done]
    unknown = [c for c in wanted if c not in by_id]
    if unknown:
        raise RetentionError(f"cell(s) {unknown} are not in plan {h[:12]}")
    again = [c for c in wanted if c in done]
    if again or not wanted:
        raise RetentionError(f"cell(s) {again or sorted(done)} already confirmed in {prereg.ledger_path(out)}")
    dirs = []
    for cid in wanted:
        for arm in prereg.ARMS:
            cfg = prereg.arm_config(plan, h, by_id[cid], arm, overrides)
            log(f"{cid}: shard {shard} of {arm} ({cfg.get('scorer')})")
            dirs.append(Path(confirm_runner(dict(by_id[cid]), arm, cfg, Path(out) / "runs" / cid, shard=shard)))
    log(f"shard {shard} of {len(wanted)} cell(s) generated; when every shard is done, run "
        f"`retention confirm --plan {plan_path} --out {out}` to merge and confirm")
    return dirs
