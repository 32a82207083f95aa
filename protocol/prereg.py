"""Pre-registration, confirmation and the append-only ledger (protocol section 5).

A *plan* fixes, before any confirm-split result exists, the cells (model x budget), the treatment
and baseline configurations, k, the seed, the max-token limit, the test (B, alpha, m), the split
manifest hash, the configuration schema version and the code version. The plan file is

    {"plan_hash": sha256(canonical_json(plan)), "registered_at": ..., "plan": {...}}

and is named `plan-<hash[:12]>.json` when written into a directory, so the hash names it.

Writing a plan registers it in the user-level registry (`protocol.ledger`): a key is created under
its hash. A plan whose cells (by identity: `protocol.plans.cell_identity`, which leaves out the
seed, note, k, token limit and test) another plan already confirmed or started is refused unless it
names that plan in `supersedes` with a reason. `confirm` runs exactly the plan's cells on the `confirm` split through an injected runner
and records each finished cell in three HMAC-keyed, write-ahead hash chains: the registry's (the
commit point, keyed by plan hash, so `--out`, the working directory and the plan's file name do not
matter), one beside the plan and one in the confirm directory (`ledger.jsonl`, which `report`
reads); irregularities go to `deviations.jsonl`. A cell in any verified ledger is confirmed, and a
second confirmation of it is refused wherever it is attempted; every attempt on a cell identity
("started" before its first generation, "confirmed" after) is kept in the registry's cell file.

This module is the protocol's entry point; the work is split by job: `protocol.plans` (building,
writing and loading plans, cell identity), `protocol.confirmation` (running and recording a
confirmation) and `protocol.ledger` (hash chains and the registry).

The runner contract (the real generation runner is plugged in by the CLI layer):

    runner(cell: dict, arm: str, arm_config: dict, out_dir: Path) -> Path

* `cell` = {"id", "model", "budget"}; `arm` is "baseline" or "treatment";
* `arm_config` is the complete run configuration to use (the plan's arm configuration plus model,
  budget, samples=k, seed, max_new_tokens, split="confirm", plan_hash, and any declared overrides);
* `out_dir` is where to create the run directory (`<confirm out>/runs/<cell id>/`);
* a plan may register its runner (`plan["runner"]`, MODULE:FUNCTION); `confirm` records the runner
  it used, and one the plan did not register is a deviation of each cell;
* a runner that takes a `shard` keyword can generate a confirmation in shards (`confirm --shard
  I/N`): called with `shard=`, it only generates that shard's pairs (no result); the plain call that
  follows merges the shards and returns the complete run directory;
* it returns a run directory holding `config.json` and `records.jsonl` (docs/records.md) and raises
  on failure (the crash is logged as a deviation and the cell can be rerun). A `ProtocolError`
  means bad input (a file, an option) and is raised as is, never logged as a crash.
"""

from __future__ import annotations

from pathlib import Path

from protocol import confirmation as _confirmation
from protocol import plans as _plans
from protocol.confirmation import (_content, _current_manifest_hash, _mismatches, runner_record)  # noqa: F401
from protocol.errors import ProtocolError
from protocol.io import canonical_json, sha256_text  # noqa: F401 - re-exported
from protocol.ledger import (GENESIS, STATE_ENV, HashChain, Registry, deviations_path, ledger_path,  # noqa: F401
                             plan_ledger_path, plan_of_chain, read_confirmation)
from protocol.plans import (ARMS, CONFIG_SCHEMA_VERSION, DEFAULT_DATASET, DEFAULT_RUNNER_SPEC,  # noqa: F401
                            PLAN_SCHEMA, _set_dotted, arm_config, cell_id, cell_identity, cell_key,
                            check_repeats, load_plan, plan_hash, superseded_plans, with_cell_stats, write_plan)

Runner = _confirmation.Runner
# Hook for the CLI layer: `retention` sets this to its generation runner; `confirm` uses it when no
# runner is passed explicitly.
DEFAULT_RUNNER: Runner | None = None


def build_plan(**kw) -> dict:
    """`protocol.plans.build_plan`, refusing settings no confirmation could honour: a
    configuration schema this code does not know, or escalated resamples below the first ones."""
    schema = kw.get("config_schema", CONFIG_SCHEMA_VERSION)
    if int(schema) > CONFIG_SCHEMA_VERSION:
        raise ProtocolError(f"--config-schema {schema} is unknown to this code (it writes schema "
                            f"{CONFIG_SCHEMA_VERSION})")
    boot, boot_max = kw.get("boot"), kw.get("boot_max")
    if boot is not None and boot_max is not None and boot_max < boot:
        raise ProtocolError(f"--boot-max {boot_max} is below --boot {boot}: the escalated resamples "
                            "cannot be fewer than the first ones")
    return _plans.build_plan(**kw)


def confirm(plan_path: Path, out_dir: Path, runner: Runner | None = None, **kw) -> list[dict]:
    """`protocol.confirmation.confirm` (arguments documented there), with `DEFAULT_RUNNER` when no
    runner is given."""
    runner = runner or DEFAULT_RUNNER
    if runner is None:
        raise ProtocolError("no generation runner is installed for confirm")
    return _confirmation.confirm(plan_path, out_dir, runner, **kw)
