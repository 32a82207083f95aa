"""math-verify (Hugging Face, optional dependency ``retention[mathverify]``) as a second opinion.

`retention grade --compare math-verify` grades every record with both graders so a user can
audit this grader against the ecosystem's standard. math-verify runs inside the same killable
worker processes as the grader (`protocol.grading.worker`), with its own SIGALRM timeouts
switched off: those cannot interrupt big-integer arithmetic and only work on a main thread,
whereas the worker's deadline kill bounds every call.

It is given what it is designed for: the whole model output (math-verify does its own answer
extraction) and the gold wrapped in ``\\boxed{}`` (its highest-priority extraction target).
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version as _version

__all__ = ["NAME", "version", "judge"]

NAME = "math-verify"


def version() -> str | None:
    """The installed math-verify version, or None when it is not installed."""
    try:
        return _version("math-verify")
    except PackageNotFoundError:
        return None


def judge(output: str | None, gold: str) -> bool | None:
    """math-verify's verdict on a whole model output; None when it extracts no answer."""
    # deferred: optional dependency (mathverify extra)
    from math_verify import parse, verify

    # it warns on every call that its own timeout is off: the worker's kill is the timeout
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    target = parse(output or "", parsing_timeout=None)
    if not target:
        return None
    reference = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    return bool(verify(reference, target, timeout_seconds=None))
