"""Options shared by several commands, so that each is spelled and documented once."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import click

from protocol.splits import SPLITS_ENV

splits_dir_option = click.option(
    "--splits-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar=SPLITS_ENV,
    help=f"Directory holding the split manifest [default: ${SPLITS_ENV}, else splits/ of the checkout "
         "run from, else splits/ beside the package].")


def bounded(name, lo, hi, lo_open=False):
    """A callback refusing values outside [lo, hi] (or (lo, hi]) and non-finite floats (click's
    FloatRange lets nan through: every comparison with it is false)."""
    def check(ctx, param, value):
        if value is None:
            return value
        if not math.isfinite(value) or (value <= lo if lo_open else value < lo) or value > hi:
            raise click.BadParameter(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param_hint=name)
        return value

    return check


def collect(name: str, build, keys: tuple[str, ...] | None = None, needs: tuple[str, ...] = ()):
    """A decorator that hands a command its options `keys` (None: the fields of `build`, a frozen
    dataclass) as one typed object: `name` = `build(*needs, **those options)`, `needs` naming objects
    an upper `collect` built first (the budget needs the run settings' model). A command function then
    takes a few settings objects rather than every option; the options themselves (flags, help,
    defaults, order) are declared as before. Place it under the options, right above the function;
    stacked, the uppermost builds first."""
    names = tuple(f.name for f in dataclasses.fields(build)) if keys is None else keys

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kwargs):
            kwargs[name] = build(*(kwargs[n] for n in needs), **{k: kwargs.pop(k) for k in names})
            return f(*args, **kwargs)

        return command

    return decorate
