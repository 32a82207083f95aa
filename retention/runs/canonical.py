"""Parameters in canonical form: typed as their mechanism declares them, floats at the compared
precision, and a mechanism at a setting its class declares trivial named as the mechanism it equals.

An arm's configuration (and so its run id and the identity of a plan's cell) is built from these
values, so two spellings of one hypothesis are one arm:

* an integer parameter (`quant.bits: int`) given as an integral float (`8.0`) is converted to the
  integer (what the mechanism runs is `8`, and `8` is recorded); a fractional one (`8.5`) is refused;
* floats follow `protocol.numbers` (`-0.0` is `0.0`; `0.7000000000000001` is `0.7`; a value with more
  than 12 significant digits is refused);
* a mechanism whose instance says `is_trivial()` (the hook every family's base class has: by default
  the class's `trivial()` parameters; `merge` above a cosine of 1, `loop-guard` with more repeats
  than its window holds) is recorded as its family's default: `pyramidkv` with `beta = 1` is
  `native` (and, the scorer being set per-layer, the `per-layer` arm).
"""

from __future__ import annotations

import types
import typing

from protocol.numbers import canonical_value
from retention.errors import RetentionError


def _integer_hint(hint) -> bool:
    """Whether a field's type is an integer (`int`, `int | None`), not a float or a bool."""
    if hint is int:
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = set(typing.get_args(hint)) - {type(None)}
        return args == {int}
    return False


def _hints(cls: type) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a plugin's annotations may name what is not importable here
        return {}


def typed_params(cls: type, params: dict, where: str) -> dict:
    """`params` of mechanism class `cls` (named `where` in errors) in canonical form (module docstring)."""
    hints = _hints(cls)
    out = {}
    for key, value in params.items():
        if _integer_hint(hints.get(key)) and isinstance(value, float):
            if not value.is_integer():
                raise RetentionError(f"{where}.{key} is an integer parameter, got {value!r}")
            value = int(value)  # 8.0 is the setting 8: run and recorded as 8
        try:
            out[key] = canonical_value(value)
        except ValueError as exc:
            raise RetentionError(f"{where}.{key}: {exc}") from None
    return out


def canonical_values(values: dict, where: str) -> dict:
    """Resolved parameter values (read back from a constructed mechanism) with floats in canonical form."""
    try:
        return {k: canonical_value(v) for k, v in values.items()}
    except ValueError as exc:
        raise RetentionError(f"{where}: {exc}") from None


def is_trivial(mechanism) -> bool:
    """Whether a constructed mechanism is at a setting that behaves as its family's default (a plugin
    class without the hook never is)."""
    hook = getattr(mechanism, "is_trivial", None)
    return bool(hook()) if callable(hook) else False
