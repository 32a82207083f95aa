"""`retention reproduce`: decode records of a run again from its recorded configuration."""

from __future__ import annotations

from pathlib import Path

import click

from retention.cli.options import splits_dir_option


@click.command("reproduce")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Only the first N records of records.jsonl [default: all].")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False), default=None,
              help="Calibration statistics of a triattention/alpha run [default: the model's default location]; "
                   "their sha256 must be the recorded one.")
@splits_dir_option
def reproduce_command(run_dir, limit, stats_path, splits_dir):
    """Re-run records of RUN_DIR from its config.json (same model revision, seeds and slot count) and print,
    per record, `identical` or the first differing token, with the sha256 of both token sequences, and
    every field that differs: the re-graded finish reason, extracted answer and verdict, and the meter.

    On a host whose instruction sets or kernel libraries differ from the records' (a bfloat16 run, or
    float32 without the ISA pinned) it says so and compares the answers only. Exit status 0 only when
    every record matches at the level compared. Nothing is written into RUN_DIR."""
    from retention.runs.reproduce import reproduce

    rep = reproduce(run_dir, limit=limit, stats=stats_path, splits_dir=splits_dir)
    for line in rep.header():
        click.echo(line)
    for check in rep.checks:
        click.echo(check.line())
    click.echo(rep.summary())
    if not rep.identical:
        raise click.exceptions.Exit(1)


commands = [reproduce_command]
