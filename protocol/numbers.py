"""Canonical numbers: the one rule by which two spellings of a parameter are the same setting.

A parameter is compared at `SIGNIFICANT_DIGITS` (12) significant decimal digits:

* `-0.0` is `0.0` (a sign on zero never changes what a mechanism computes from a threshold or radius);
* a float within a few rounding steps of its 12-digit decimal (`0.7000000000000001`, the result of
  `0.1 * 7`) *is* that decimal (`0.7`): the two spellings are one cell;
* a float that differs from its 12-digit decimal by more than rounding noise (`0.123456789012345`)
  is not representable at the compared precision and is refused (`canonical_float` raises
  `ValueError`; callers turn it into their own one-line error).

Every committed plan and run configuration holds values already at most 12 significant digits, so
each keeps its hash (tests/committed/test_hashes.py recomputes them).
"""

from __future__ import annotations

import math

SIGNIFICANT_DIGITS = 12
# How far (relative) a float may sit from its 12-digit decimal and still be that decimal: eight
# rounding steps of a double (arithmetic such as 0.1 * 7 lands one or two steps away).
_NOISE = 8 * 2.0 ** -52


def canonical_float(x: float) -> float:
    """`x` at the compared precision (module docstring); ValueError when `x` has more precision than
    that. Non-finite values are returned unchanged (the mechanism's own validation refuses them)."""
    x = float(x)
    if not math.isfinite(x):
        return x
    if x == 0.0:
        return 0.0  # -0.0 and 0.0 are one setting
    rounded = float(f"{x:.{SIGNIFICANT_DIGITS}g}")
    if abs(rounded - x) > _NOISE * abs(x):
        raise ValueError(f"{x!r} has more than {SIGNIFICANT_DIGITS} significant digits, the precision parameters "
                         f"are compared at (write {rounded!r})")
    return rounded


def canonical_value(value):
    """`value` with every float (nested in lists and dicts too) at the compared precision; bools,
    ints and strings unchanged."""
    if isinstance(value, bool) or not isinstance(value, (float, list, tuple, dict)):
        return value
    if isinstance(value, float):
        return canonical_float(value)
    if isinstance(value, dict):
        return {k: canonical_value(v) for k, v in value.items()}
    return type(value)(canonical_value(v) for v in value)


def identity_number(x: float) -> float:
    """A number as a cell identity compares it: a float at the compared precision, never refused
    (a plan registered before this rule is compared at it rather than rejected)."""
    x = float(x)
    if not math.isfinite(x) or x == 0.0:
        return 0.0 if x == 0.0 else x
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}")
