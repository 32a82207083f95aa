"""Options shared by several commands, so that each is spelled and documented once."""

from __future__ import annotations

from pathlib import Path

import click

from protocol.splits import SPLITS_ENV

splits_dir_option = click.option(
    "--splits-dir", type=click.Path(file_okay=False, path_type=Path), default=None, envvar=SPLITS_ENV,
    help=f"Directory holding the split manifest [default: ${SPLITS_ENV}, else splits/ of the checkout "
         "run from, else splits/ beside the package].")
