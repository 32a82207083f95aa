"""`retention merge`: shards of runs into run directories with the layout of unsharded runs."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("merge")
@click.argument("shard_dirs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Parent folder of the merged run directories (one per configuration, named as `run` names them).")
def merge_command(shard_dirs, out):
    """Merge the shards in SHARD_DIRS (run directories, or folders holding them) into --out.

    Refuses, writing nothing, shards of mismatched configurations, duplicated or missing
    (problem, sample) pairs, missing shards, and shards run by another code version or split manifest.
    """
    from retention.runs.merge import merge

    for target in merge(shard_dirs, out):
        n = sum(1 for line in (target / "records.jsonl").read_text(encoding="utf-8").splitlines() if line.strip())
        click.echo(f"{target}: {n} records merged")


commands = [merge_command]
