"""`retention` commands in the test's own process (a subprocess would import torch again for each call)."""

from __future__ import annotations

from click.testing import CliRunner, Result


def invoke(*args) -> Result:
    """`retention ARGS...` (each argument as text); the result, whatever the exit status."""
    from retention.cli import main  # here, not at the top: protocol tests import this without the runtime

    return CliRunner().invoke(main, [str(a) for a in args])


def ok(*args) -> Result:
    """`invoke`, asserting the command succeeded (its output in the failure message)."""
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    return res
