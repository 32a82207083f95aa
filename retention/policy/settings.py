"""What the four non-scoring base classes share about their settings (a leaf: imports nothing)."""

from __future__ import annotations


def trivial_setting(mechanism, trivial: dict | None) -> bool:
    """Whether `mechanism` holds every key of `trivial` (its class's `trivial()` parameters, under
    which it behaves exactly as the family's default) at that value; False when there is none."""
    return trivial is not None and all(getattr(mechanism, k, None) == v for k, v in trivial.items())
