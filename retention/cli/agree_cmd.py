"""`retention agree RUN_A RUN_B`: greedy token agreement between two engines on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import click

from retention.errors import RetentionError


@click.command("agree")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def agree_command(run_a, run_b, as_json):
    """Tokens before the first divergence, per (problem, sample), between run directories RUN_A and
    RUN_B of the same configuration on two engines (e.g. `--engine hf` and `--engine vllm`)."""
    from protocol.report import load_run
    from retention.runs.engines.agreement import compare_records, config_differences, summarize, verdict

    a, b = load_run(run_a, grade=_no_grade), load_run(run_b, grade=_no_grade)
    if run_a.resolve() == run_b.resolve() or a.config == b.config:
        raise RetentionError(f"{run_a} and {run_b} are the same run (one configuration, one engine): "
                             "agreement compares the runs of two engines")
    differ = config_differences(a.config, b.config)
    if differ:
        raise RetentionError(f"{run_a.name} and {run_b.name} are not the same experiment: they differ in {differ}")
    pairs = compare_records(a.records, b.records)
    summary = summarize(pairs)
    engines = [r.config.get("engine", "hf") for r in (a, b)]
    if as_json:
        click.echo(json.dumps({"engines": engines, **summary, "verdict": verdict(a.config, summary),
                               "pairs_detail": [p.__dict__ for p in pairs]}))
        return
    click.echo(f"{'problem':<32} {'sample':>6} {'len ' + engines[0]:>9} {'len ' + engines[1]:>9} {'agreed':>7}")
    for p in pairs:
        mark = "" if p.first_divergence is None else " (diverged)"
        click.echo(f"{p.problem_id:<32} {p.sample:>6} {p.length_a:>9} {p.length_b:>9} {p.agreed_tokens:>7}{mark}")
    click.echo(f"{engines[0]} vs {engines[1]}: {summary['identical']}/{summary['pairs']} identical, tokens before the "
               f"first divergence median {summary['median_agreed_tokens']}, min {summary['min_agreed_tokens']} "
               f"({verdict(a.config, summary)})")


def _no_grade(text, gold):
    return None  # agreement needs tokens only


commands = [agree_command]
