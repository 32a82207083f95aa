"""`retention check-scorer`: the contract kit on one scorer (built-in or plugin)."""

from __future__ import annotations

import click


@click.command("check-scorer")
@click.argument("spec")
@click.option("--param", "params", multiple=True, metavar="NAME.KEY=VALUE",
              help="A parameter of the scorer, e.g. --param alpha.lam=0.5 or, for a plugin, --param "
                   "keynorm.power=2 (its class's name) or the spec as given (repeatable).")
@click.option("--context", type=click.IntRange(min=0, max=1 << 16), default=8192, show_default=True,
              help="Prompt tokens of the compaction-share figure (0: skip the figure).")
@click.option("--share-budget", type=click.IntRange(min=8, max=1 << 16), default=1024, show_default=True,
              help="Budget of the compaction-share figure.")
@click.option("--share-tokens", type=click.IntRange(min=2, max=1 << 16), default=512, show_default=True,
              help="Decode tokens of the compaction-share figure.")
def check_scorer_command(spec, params, context, share_budget, share_tokens):
    """Check that scorer SPEC (a built-in name, an installed plugin name, package.module:Class or
    path/to/file.py:Class) holds the contract every scorer must hold, on tiny random models.

    One line per check (PASS/FAIL, INFO for the compaction-share figure); exits 1 unless every check
    passes.
    """
    from retention.contract import run_checks
    from retention.runs.scorer_options import resolve
    from retention.scorers import get_scorer_class

    get_scorer_class(spec)  # a plugin that does not import is one error line, not a failed check
    options = resolve([spec], {}, params)[spec]
    results = run_checks(spec, options, context=context, share=context > 0, share_budget=share_budget,
                         share_tokens=share_tokens)
    for r in results:
        click.echo(r.line())
    failed = [r for r in results if r.ok is False]
    click.echo(f"{spec}: {sum(r.ok is True for r in results)}/{sum(r.ok is not None for r in results)} checks pass")
    if failed:
        raise click.exceptions.Exit(1)


commands = [check_scorer_command]
