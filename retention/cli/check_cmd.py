"""`retention check` and `retention check-scorer`: the contract kit on one mechanism of any family
(built-in or plugin)."""

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
    from retention.policy.registry import get_scorer_class

    get_scorer_class(spec)  # a plugin that does not import is one error line, not a failed check
    options = resolve([spec], {}, params)[spec]
    results = run_checks(spec, options, context=context, share=context > 0, share_budget=share_budget,
                         share_tokens=share_tokens)
    _print(spec, results)


@click.command("check")
@click.argument("target")
@click.option("--param", "params", multiple=True, metavar="NAME.KEY=VALUE",
              help="A parameter of the mechanism, e.g. --param quant.bits=4 (repeatable).")
@click.option("--scorer", default="triattention", show_default=True,
              help="The scorer of the arm a non-scoring mechanism is checked in.")
@click.option("--context", type=click.IntRange(min=0, max=1 << 16), default=0, show_default=True,
              help="Prompt tokens of the compaction-share figure of the arm (0: skip the figure).")
def check_command(target, params, scorer, context):
    """Check that mechanism TARGET holds its family's contract on tiny random models: FAMILY:NAME with
    FAMILY one of cadence, routing, state, decoding (e.g. state:quant, decoding:path/to/file.py:Guard),
    or a scorer name (the checks of `check-scorer`).

    One line per check; exits 1 unless every check passes.
    """
    from retention.contract import run_checks
    from retention.contract.families import parse_target, run_family_checks
    from retention.runs.scorer_options import mechanism_options, resolve

    from retention.policy.registry import mechanism_class
    from retention.policy.registry import get_scorer_class

    family, name = parse_target(target)
    get_scorer_class(scorer if family != "scorer" else name)  # one error line for an unknown or broken name
    if family != "scorer":
        mechanism_class(family, name)
    if family == "scorer":
        results = run_checks(name, resolve([name], {}, params)[name], share=context > 0, context=context)
    else:
        rest, entries = mechanism_options(params, {family: name}, [scorer])
        if rest:
            raise click.UsageError(f"--param {rest[0]!r} is not a parameter of {target}")
        entry = entries[family]
        results = run_family_checks(family, name, entry["params"] if isinstance(entry, dict) else {}, scorer=scorer,
                                    share=context > 0, context=context)
    _print(target, results)


def _print(what: str, results) -> None:
    """One line per check and a count; exit 1 unless every check passes."""
    for r in results:
        click.echo(r.line())
    click.echo(f"{what}: {sum(r.ok is True for r in results)}/{sum(r.ok is not None for r in results)} checks pass")
    if any(r.ok is False for r in results):
        raise click.exceptions.Exit(1)


commands = [check_scorer_command, check_command]
