"""Errors of the protocol package; the CLI prints them as one line and exits non-zero."""


class ProtocolError(Exception):
    """A user-facing protocol error: a split that fails verification, a tampered plan or ledger, ..."""
