"""Command options grouped into typed objects (`retention.cli.options.collect`): no command function
takes more than 15 parameters, and each group reaches it as its object."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import click
from click.testing import CliRunner

from retention.cli import main
from retention.cli.options import collect

MAX_PARAMETERS = 15


def _commands(group: click.Group, prefix: str = "retention"):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", cmd


def test_no_command_function_takes_more_than_fifteen_parameters():
    counts = {name: len(inspect.signature(inspect.unwrap(cmd.callback)).parameters) for name, cmd in _commands(main)}
    assert counts["retention run"] <= 4
    assert {n: c for n, c in counts.items() if c > MAX_PARAMETERS} == {}


@dataclass(frozen=True)
class _Pair:
    a: int
    b: int


def test_collect_hands_the_options_as_one_object_built_in_order():
    @click.command()
    @click.option("--a", type=int, default=1)
    @click.option("--b", type=int, default=2)
    @click.option("--c", type=int, default=3)
    @collect("pair", _Pair)  # its fields name the options
    @collect("total", lambda pair, c: pair.a + pair.b + c, ("c",), needs=("pair",))
    def cmd(pair, total):
        """Help of the command."""
        click.echo(f"{pair!r} {total}")

    res = CliRunner().invoke(cmd, ["--b", "5"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "_Pair(a=1, b=5) 9"
    assert "Help of the command." in CliRunner().invoke(cmd, ["--help"]).output
