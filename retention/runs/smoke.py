"""A plugin's cheap checks before a plan registers it (`retention preregister`).

`run` and `confirm` refuse a plugin whose outputs break the contract at its first compaction
(`retention.policy.guard.GuardedPolicy`, which every arm with a plugin runs under). A plan is
registered before anything runs, so `preregister` runs the same guard once per arm first, on
`tiny-random` (seconds): the arm's own mechanisms at a small budget, three prompts of different lengths
decoded past several compactions. A plugin failing a cheap check (score shape and dtype, NaN, kept
indices, metered KiB finite and not below the buffers' floor, logits' shape and dtype, a row
outgrowing `b + span`) is refused in one line before its cell is registered and blocked.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from protocol.plans import ARMS, arm_config
from retention.errors import RetentionError
from retention.models import load_model
from retention.runs.arms import validate_arm
from retention.runs.scorer_options import scorer_fields
from retention.runtime.engine import Request, SamplingConfig, run_engine
from retention.policy.guard import GuardRefusal
from retention.policy.registry import FAMILIES, is_builtin
from retention.policy.registry import scorer_identity
from retention.policy.scoring.calibration import calibrate

SMOKE_BUDGET, SMOKE_INTERVAL, SMOKE_TOKENS = 24, 4, 40
# Three prompts of different lengths: rows compacted at prefill and apart, padding in the views.
SMOKE_PROMPTS = [list(range(3 + i, 40 + 3 * i)) for i in range(3)]


def check_plan_runs(plan: dict) -> None:
    """Every arm of every cell built exactly as `confirm` will build it (its mechanisms constructed,
    its engine asked: `validate_arm`, `ArmSpec.policy`), and each arm's plugins through their cheap
    checks (`smoke_plugins`), before the plan is registered: a plan that registers can run."""
    for cell in plan["cells"]:
        for arm in ARMS:
            try:
                validate_arm(arm_config(plan, "0" * 64, cell, arm)).policy()
            except RetentionError as exc:
                raise RetentionError(f"{arm} of cell {cell['id']}: {exc}") from None
    for arm in ARMS:
        try:
            smoke_plugins(plan[arm])
        except RetentionError as exc:
            raise RetentionError(f"the {arm}: {exc}") from None


def smoke_plugins(cfg: dict) -> None:
    """Decode arm `cfg`'s mechanisms on tiny-random under the run's guard when any is a plugin; a
    `RetentionError` naming the plugin when one fails a cheap check. An arm tiny-random cannot hold
    (a scorer reading what it lacks) is left to `run`'s guard on the real model."""
    arm = {k: cfg[k] for k in ("scorer", "scorer_params", *FAMILIES) if cfg.get(k) is not None}
    if not _has_plugin(arm):
        return
    loaded = load_model("tiny-random")
    with tempfile.TemporaryDirectory(prefix="retention-smoke-") as tmp:
        params = {k: v for k, v in (arm.get("scorer_params") or {}).items() if k != "stats"}
        if "stats" in scorer_fields(arm["scorer"]):  # tiny-random's own statistics
            ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(0))
            params["stats"] = str(calibrate(loaded.model, ids).save(Path(tmp) / "tiny.safetensors"))
        try:
            spec = validate_arm(dict(arm, model="tiny-random", budget=SMOKE_BUDGET, interval=SMOKE_INTERVAL,
                                     scorer_params=params))
        except RetentionError:
            return
        policy = spec.policy()
        policy.prepare(loaded.tokenizer)
        reqs = [Request(i, p, i) for i, p in enumerate(SMOKE_PROMPTS)]
        try:
            run_engine(loaded.model, reqs, policy, SamplingConfig(max_new_tokens=SMOKE_TOKENS, ignore_eos=True), set(),
                       loaded.geometry.kib_per_token, batch_size=len(reqs))
        except GuardRefusal:
            raise
        except Exception as exc:  # noqa: BLE001 - a plugin failing on tiny-random: one line naming it
            raise RetentionError(f"{', '.join(spec.plugins())} raised on tiny-random before registration "
                                 f"({type(exc).__name__}: {exc})") from None


def _has_plugin(arm: dict) -> bool:
    """Whether the arm names a scorer or mechanism from outside the package (by name: nothing built)."""
    if scorer_identity(arm["scorer"]) is not None:
        return True
    for fam in FAMILIES:
        entry = arm.get(fam)
        name = entry.get("name") if isinstance(entry, dict) else entry
        if isinstance(name, str) and not is_builtin(fam, name):
            return True
    return False
