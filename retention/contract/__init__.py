"""The contract kit (`retention check-scorer`): the invariants every scorer must hold, built-in or
plugin, checked on tiny random models. See `retention.contract.checks`."""

from retention.contract.checks import CheckResult, run_checks

__all__ = ["CheckResult", "run_checks"]
