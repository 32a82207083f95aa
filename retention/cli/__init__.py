"""The `retention` command line.

Every subcommand lives in one module of this package and is listed in `_MODULES`; each module
exposes `commands`, a list of click commands. Heavy imports (torch, transformers, sympy) happen
inside the commands so that `retention --help` stays fast.

Expected failures (`RetentionError`, `ProtocolError`, bad files) end with one line and exit 1,
never with a traceback.
"""

from __future__ import annotations

import importlib

import click

from protocol.errors import ProtocolError
from retention import __version__
from retention.errors import RetentionError

_MODULES = ("run_cmd", "calibrate_cmd", "data_cmds", "protocol_cmds", "bench_cmd", "merge_cmd", "agree_cmd")


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (RetentionError, ProtocolError) as exc:
            raise click.ClickException(str(exc)) from None
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            raise click.ClickException(f"{exc.strerror or exc}: {exc.filename}") from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="retention")
def main():
    """KV-retention evaluation harness for long-form math reasoning."""


for _name in _MODULES:
    for _cmd in importlib.import_module(f"retention.cli.{_name}").commands:
        main.add_command(_cmd)
