"""What the four non-scoring base classes share about their settings (a leaf: imports nothing)."""

from __future__ import annotations


class TrivialSetting:
    """The `trivial` hooks of a non-scoring family's base class: the parameters under which a
    mechanism must behave exactly as its family's default (`fixed`, `native`, `full`, `none`; checked
    by the contract kit), and whether an instance sits at them (its arm is then the default's cell:
    `retention.runs.canonical`)."""

    @classmethod
    def trivial(cls) -> dict | None:
        """Parameters under which this mechanism must behave exactly as its family's default, or None."""
        return None

    def is_trivial(self) -> bool:
        """By default: every key of `trivial()` held at its value; False when there is none."""
        trivial = self.trivial()
        return trivial is not None and all(getattr(self, k, None) == v for k, v in trivial.items())
