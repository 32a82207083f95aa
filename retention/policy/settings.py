"""What the four non-scoring base classes share about their settings (a leaf: imports nothing): the
`trivial` hooks, and how a parameter added after configurations were written is recorded."""

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

    @classmethod
    def written_params(cls, params: dict) -> dict:
        """A written configuration's parameters as it ran (by default as written; `Quant` adds the
        `store` that configurations written before it ran with)."""
        return params

    @classmethod
    def new_run_params(cls) -> dict:
        """Parameters a run started now gets where its entry sets none (`registry.new_run_entry`)."""
        return {}

    @classmethod
    def unrecorded(cls) -> dict:
        """Parameters left out of the recorded configuration at these values (a configuration says
        them by leaving them out, so that its hash is the one it had before they existed)."""
        return {}
