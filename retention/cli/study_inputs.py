"""Helpers shared by `retention preregister` and `retention confirm`: the code version and configuration
schema a plan or a confirmation names, and KEY=VALUE options."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import click


def current_code_version() -> str:
    """`retention` version plus the git commit of this checkout (`.dirty` for local edits)."""
    from retention import __version__

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return __version__
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read-only: never refresh the index
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5, env=env, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5, env=env, check=True).stdout.strip()
        # An untracked module under the package folders (one shadowing a tracked one, say) runs as
        # much as a tracked edit does; untracked files elsewhere (results, notes) are not code.
        dirty = dirty or subprocess.run(["git", "-C", str(root), "ls-files", "--others", "--exclude-standard",
                                         "--", "retention", "protocol"], capture_output=True, text=True,
                                        timeout=5, env=env, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+g{sha}{'.dirty' if dirty else ''}"


def runtime_schema() -> int:
    """The runtime's configuration schema version: what a registered arm configuration means."""
    from retention.runs.runner import CONFIG_SCHEMA_VERSION

    return CONFIG_SCHEMA_VERSION


def _parse_value(text: str):
    """JSON when it parses (numbers, true, null, objects), else the plain string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def key_values(items, what: str) -> dict:
    """KEY=VALUE items as a dict, each value JSON when it parses (`what`: the option, for the error)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.ClickException(f"{what}: {item!r} is not KEY=VALUE")
        out[key] = _parse_value(value)
    return out
