"""Errors that end a command with one clear line (the CLI turns them into `Error: ...`, exit 1)."""


class RetentionError(Exception):
    """A user-facing error of the runtime: bad option, unknown model, missing statistics, ..."""
