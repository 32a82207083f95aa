"""`retention size`: how many problems of a job fit in the time left on this host (`retention.runs.sizing`)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from retention.cli.options import bounded, collect, splits_dir_option


def _job_shape(**options):
    """`retention.runs.sizing.JobShape` of the job's options (imported when the command runs)."""
    from retention.runs.sizing import JobShape

    return JobShape(**options)


@click.command("size")
@click.option("--model", required=True, help="Model alias or local folder (as `retention run`).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="bfloat16", show_default=True)
@click.option("--limit", "requested", type=click.IntRange(min=1, max=201), required=True,
              help="Problems the job asks for (the most it will run).")
@click.option("--seconds", type=float, required=True, callback=bounded("--seconds", -1e9, 1e9),
              help="Seconds the job has left (0 or less: none; one problem runs).")
@click.option("--max-new-tokens", "tokens", type=click.IntRange(min=1, max=1 << 20), required=True)
@click.option("--batch-size", "batch", type=click.IntRange(min=1, max=1024), required=True,
              help="The job's slot count.")
@click.option("--retention-arms", type=click.IntRange(min=0, max=64), default=2, show_default=True,
              help="Arms decoding a budget cache.")
@click.option("--full-arms", type=click.IntRange(min=0, max=64), default=1, show_default=True,
              help="Arms decoding the full cache.")
@click.option("--fidelity/--no-fidelity", default=True, show_default=True,
              help="The retention arms decode a full cache alongside (the fidelity proxy); dropped when the "
                   "smallest job with it does not fit.")
@click.option("--commands", type=click.IntRange(min=1, max=64), default=2, show_default=True,
              help="Run commands of the job (each loads the model once).")
@click.option("--min-problems", type=click.IntRange(min=1, max=201), default=2, show_default=True,
              help="Fewest problems the job may be cut to (a paired report needs two).")
@click.option("--min-tokens", type=click.IntRange(min=1, max=1 << 20), default=128, show_default=True,
              help="Shortest token limit the job may be cut to.")
@click.option("--solved-from", "solved_from", type=click.Path(file_okay=False, exists=True), default=None,
              help="Committed runs folder: keep answers at least as long as the median solved answer of this "
                   "model there needed, dropping the fidelity proxy and then problems first (none solved: ignored).")
@click.option("--margin", type=float, default=0.6, show_default=True, callback=bounded("--margin", 0.05, 1.0),
              help="Share of the seconds left that the prediction may fill.")
@click.option("--out", "note", type=click.Path(dir_okay=False), default=None,
              help="Write the decision as JSON to this file (a runs folder's sizing.json: `retention report` "
                   "states it).")
@splits_dir_option
@collect("shape", _job_shape, ("tokens", "batch", "retention_arms", "full_arms", "fidelity", "commands"))
def size_command(model, dtype, requested, seconds, shape, min_problems, min_tokens, solved_from, margin, note,
                 splits_dir):
    """Measure this host's decode step on MODEL and print the problem count and token limit, at most
    --limit and --max-new-tokens, whose pessimistic predicted time fits --seconds (stdout: `P T F`,
    F `fidelity` or `no-fidelity`: whether the job keeps the fidelity proxy; stderr: why;
    `retention.runs.sizing`)."""
    from retention.models import load_model
    from retention.runs.sizing import size_job, solved_tokens, write_note

    from protocol.io import check_writable
    from protocol.splits import load_split

    if shape.retention_arms + shape.full_arms == 0:
        raise click.UsageError("a job needs at least one arm (--retention-arms or --full-arms)")
    if note:
        check_writable(Path(note), "--out")  # before the model loads
    problems = load_split("dev", splits_dir=splits_dir)
    t0 = time.perf_counter()
    loaded = load_model(model, dtype=dtype, device="cpu")
    load_seconds = time.perf_counter() - t0
    solved = None if solved_from is None else solved_tokens(Path(solved_from), loaded.name)
    sizing = size_job(loaded, problems, shape, requested, seconds - (time.perf_counter() - t0), load_seconds, margin,
                      min_problems, min_tokens, solved)
    if note:
        write_note(sizing, Path(note), loaded.name)
    click.echo(f"retention size: {sizing.line()}", err=True)
    click.echo(f"{sizing.problems} {sizing.tokens} {'fidelity' if sizing.fidelity else 'no-fidelity'}")


commands = [size_command]
