"""What a confirmation runs with, checked before anything is written.

The runner: `--runner MODULE:FUNCTION`, else the plan's registered runner, else
`protocol.prereg.DEFAULT_RUNNER`, else the built-in `retention.runs.jobs.confirm_runner`; one that cannot
be imported or does not take the runner contract's arguments (`protocol.prereg`) is refused. Each
arm's configuration, as the runner will receive it: no key the run configuration does not know (a
mistyped `--override`) and valid as `run` validates an arm. Both are input errors, never a crash
deviation of the confirmation.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from pathlib import Path

from protocol import prereg
from protocol.plans import _PLAN_LEVEL_KEYS
from retention.errors import RetentionError
from retention.models.gguf import require_weights
from retention.plugins import differing_keys, helper_files
from retention.runs import arms


# Runner specs registered before the job modules moved into `retention.runs` (plans keep their spec).
MOVED_RUNNERS = {"retention.jobs:confirm_runner": "retention.runs.jobs:confirm_runner"}


def load_runner(spec: str):
    """The callable MODULE:FUNCTION names, refused unless it takes (cell, arm, arm_config, out_dir)."""
    module, sep, name = MOVED_RUNNERS.get(spec, spec).partition(":")
    if not sep or not module or not name:
        raise RetentionError(f"--runner: expected MODULE:FUNCTION, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RetentionError(f"cannot load runner {spec}: {exc}") from None
    if not callable(fn):
        raise RetentionError(f"runner {spec} is not callable")
    try:
        inspect.signature(fn).bind({}, "treatment", {}, Path("."))
    except TypeError:
        raise RetentionError(f"runner {spec} does not take (cell, arm, arm_config, out_dir)") from None
    except ValueError:  # no introspectable signature (some builtins): let the call decide
        pass
    return fn


def runner_sources(spec: str) -> dict[str, str]:
    """{file: sha256} of a runner's code: its module's file and the modules imported from its folder
    (`retention.plugins.helper_files`, as a file plugin is identified), keyed relative to that folder."""
    fn = load_runner(spec)
    module = sys.modules.get(getattr(fn, "__module__", ""))
    file = Path(getattr(module, "__file__", "") or "")
    if not file.is_file():
        raise RetentionError(f"runner {spec} has no source file to identify it by; define it in a module")
    file = file.resolve()
    return {p.relative_to(file.parent).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in helper_files(file)}


def check_runner_sources(plan: dict, spec: str | None) -> None:
    """Refuse to confirm with the plan's registered runner when its code changed since registration
    (a plan registered before runner sources were recorded has none to compare)."""
    registered = plan.get("runner_sources")
    if not registered or (spec is not None and spec != plan.get("runner")):
        return  # another runner than the registered one is a logged "runner" deviation
    current = runner_sources(plan["runner"])
    if current != registered:
        keys = differing_keys({"runner_sources": registered}, {"runner_sources": current})
        raise RetentionError(f"the registered runner {plan['runner']} changed since registration ({', '.join(keys)} "
                             "differ); register the new code as a new plan")


def resolve_runner(spec: str | None, plan: dict):
    """(runner, spec to record in the ledger). The spec is None when the runner is the plan's own
    registered one (`protocol.prereg.DEFAULT_RUNNER` stands for the built-in runner)."""
    if spec:
        return load_runner(spec), spec
    if plan.get("runner"):
        return load_runner(plan["runner"]), plan["runner"]
    if prereg.DEFAULT_RUNNER is not None:
        return prereg.DEFAULT_RUNNER, None
    try:
        runner = getattr(importlib.import_module("retention.runs.jobs"), "confirm_runner", None)
    except ImportError:
        runner = None
    if runner is None:
        raise RetentionError("no generation runner is available for confirm "
                             "(the runtime has not installed one; see --runner)")
    return runner, prereg.DEFAULT_RUNNER_SPEC


def validate_confirm_arm(cfg: dict) -> None:
    """One arm of a confirmation as the runner will receive it (`protocol.plans.arm_config`)."""
    unknown = sorted(set(cfg) - arms._ARM_KEYS - _PLAN_LEVEL_KEYS - {"model_revision", "dataset"})
    if unknown:
        allowed = sorted((arms._ARM_KEYS - {"stats_sha256"}) | {"samples", "seed", "max_new_tokens"})
        raise RetentionError(f"unknown configuration key(s) {unknown} (a mistyped --override?); allowed: {allowed}")
    arms.validate_arm(cfg)
    require_weights(cfg["model"])  # before the registry records the cell as started
