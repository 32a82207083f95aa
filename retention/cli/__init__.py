"""The `retention` command line.

Every subcommand lives in one module of this package and is listed in `_MODULES`; each module
exposes `commands`, a list of click commands. Heavy imports (torch, transformers, sympy) happen
inside the commands so that `retention --help` stays fast.

Every failure caused by input ends with exactly one line on stderr, `Error: <message>`, and exit
status 1, never a traceback: `RetentionError`/`ProtocolError`, OS errors on the user's files, and
click's own usage errors (whose message text click words; only the usage lines and the exit status 2
are replaced). Anything else is a bug; it is still reported as one `Error:` line (exit 1), with the
traceback only when `RETENTION_DEBUG=1`.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from protocol.errors import ProtocolError
from retention import __version__
from retention.errors import RetentionError

# One command module per line (keeps additions from different branches apart).
_MODULES = (
    "run_cmd",
    "calibrate_cmd",
    "data_cmds",
    "stats_cmd",
    "preregister_cmd",
    "confirm_cmd",
    "report_cmd",
    "bench_cmd",
    "conformance_cmd",
    "audit_cmd",
    "merge_cmd",
    "agree_cmd",
    "check_cmd",
    "reproduce_cmd",
    "view_cmd",
    "size_cmd",
)
DEBUG_ENV = "RETENTION_DEBUG"


def error_message(exc: BaseException) -> str:
    """The one-line message of a failure (newlines folded: one line, always)."""
    if isinstance(exc, click.ClickException):
        text = exc.format_message()
    elif isinstance(exc, (RetentionError, ProtocolError)):
        text = str(exc)
    elif isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        text = f"{exc.strerror or exc}{where}"
    elif isinstance(exc, UnicodeError):
        text = f"input is not valid UTF-8 ({exc})"
    elif isinstance(exc, RecursionError):
        text = "input nested too deeply"
    elif isinstance(exc, MemoryError):
        text = "out of memory (an input asks for more than this machine has)"
    else:
        text = f"unexpected {type(exc).__name__}: {exc} (a bug; set {DEBUG_ENV}=1 for the traceback)"
    return " ".join(text.split()) or type(exc).__name__


class _Group(click.Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            # Outside standalone mode click returns (not raises) the code of a command's
            # `click.exceptions.Exit`, so an exit status set by a command arrives here.
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # a bare command asks for its help
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(0)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Error: aborted", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("Error: interrupted", err=True)
            sys.exit(130)
        except Exception as exc:  # noqa: BLE001 - the promise: one line, never a traceback
            if os.environ.get(DEBUG_ENV) == "1" and not isinstance(exc, click.ClickException):
                raise
            click.echo(f"Error: {error_message(exc)}", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="retention")
def main():
    """KV-retention evaluation harness for long-form math reasoning."""


for _name in _MODULES:
    for _cmd in importlib.import_module(f"retention.cli.{_name}").commands:
        main.add_command(_cmd)
