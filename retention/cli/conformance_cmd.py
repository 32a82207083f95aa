"""`retention conformance`: check the scorers against the published reference code's outputs."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("conformance")
@click.argument("directory", required=False, type=click.Path(file_okay=False, path_type=Path))
def conformance_command(directory):
    """Run every scorer on the reference cases in DIRECTORY (default: the golden vectors shipped
    with the package, the PyramidKV and AdaKV routing cases included) and compare kept sets and
    scores (for the routings: budgets and kept slots) with the reference outputs.

    Prints one line per case; exits 1 if any case fails.
    """
    from retention.runs.conformance import check_dir

    results = check_dir(directory)
    for r in results:
        click.echo(r.line())
    failed = [r for r in results if not r.ok]
    click.echo(f"{len(results) - len(failed)}/{len(results)} cases pass")
    if failed:
        raise click.exceptions.Exit(1)


commands = [conformance_command]
