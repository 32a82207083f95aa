"""What `preregister` needs to say a plan's power and time before the confirm split is touched.

* `dev_pairs`: for each cell, the dev runs (among the ones given) of its model and budget whose arms
  are the plan's treatment and baseline, key for key of the resolved run configuration (what is run
  and how much, the split, samples, seed, limit and execution keys aside);
* `plan_power`: each cell's minimum detectable effect from those runs (`protocol.power`);
* `plan_wall_time`: the predicted wall time of the confirmation on this host from a short measurement
  (`retention.runs.sizing.measure_host`, as `retention size` measures), per cell and in all.
"""

from __future__ import annotations

import platform

from protocol.data import AIME_PROBLEMS
from protocol.power import cell_power, paired_matrix, power_record, underpowered
from protocol.prereg import ARMS, arm_config
from protocol.runs import Run, find_run_dirs, load_run
from protocol.splits import COUNTS, load_split

from retention.errors import RetentionError
from retention.runs.arms import validate_arm
from retention.runs.identity import canonical_models
from retention.runs.sizing import confirm_seconds, measure_host

# Keys that say how much, where or on which problems an arm runs, not which arm it is.
# The model's identity (`model`, `model_id`, `model_revision`, `model_quant`: a run records what it loaded, a
# plan's arm names the model only) is matched by the cell's model instead.
NOT_ARM = {"split", "samples", "seed", "max_new_tokens", "limit", "data", "plan_hash", "device", "dtype", "engine",
           "fidelity", "sampler", "model", "model_id", "model_revision", "model_quant", "prompt", "budget_kib"}
# A key a configuration leaves out has its default (a run records more of them than a plan's arm).
DEFAULTS = {"protect_prompt": False, "temperature": 0.6, "top_p": 0.95, "ignore_eos": False, "accounting": "mean",
            "dataset": "math500"}


def resolved_arm(plan: dict, cell: dict, arm: str) -> dict:
    """Arm `arm` of `cell` as `confirm` will run it (the run configuration `validate_arm` builds)."""
    return validate_arm(arm_config(plan, "0" * 64, cell, arm)).config


def same_arm(run_config: dict, arm: dict) -> bool:
    """Whether a run's configuration is the arm `arm`, key for key outside `NOT_ARM`."""
    keys = (set(run_config) | set(arm)) - NOT_ARM
    return all(run_config.get(k, DEFAULTS.get(k)) == arm.get(k, DEFAULTS.get(k)) for k in keys)


def confirm_problems(plan: dict, arm: dict) -> int:
    """Problems each arm of the plan confirms on: the confirm split, or the arm's limit."""
    total = COUNTS["confirm"] if plan.get("dataset", "math500") == "math500" else AIME_PROBLEMS
    return min(total, int(arm["limit"])) if arm.get("limit") else total


def dev_pairs(plan: dict, runs: list[Run]) -> dict[str, tuple[Run, Run]]:
    """{cell id: (treatment run, baseline run)} among the dev `runs`; a cell with none or several
    matching runs of an arm is refused, naming them."""
    canon: dict[str, str] = {}

    def model_of(run: Run) -> str:
        if run.model not in canon:
            try:
                canon[run.model] = canonical_models([run.model], {})[0][0]
            except RetentionError:
                canon[run.model] = run.model
        return canon[run.model]

    out = {}
    for cell in plan["cells"]:
        pair = {}
        for arm in ARMS:
            want = resolved_arm(plan, cell, arm)
            found = [r for r in runs if r.split == "dev" and model_of(r) == cell["model"] and r.budget == cell["budget"]
                     and same_arm(r.config, want)]
            if len(found) != 1:
                what = "no dev run" if not found else f"{len(found)} dev runs ({', '.join(r.run_id for r in found)})"
                raise RetentionError(f"power: {what} of cell {cell['id']} matches the plan's {arm} "
                                     f"({want['scorer']}); give exactly one with --dev")
            pair[arm] = found[0]
        out[cell["id"]] = (pair["treatment"], pair["baseline"])
    return out


def plan_power(plan: dict, runs: list[Run], power: float, bound_pp: float, allowed: bool) -> tuple[dict, list[str]]:
    """(the plan's "power" record, the cells whose MDE is above `bound_pp`)."""
    cells = {}
    for cid, (t, b) in dev_pairs(plan, runs).items():
        cell = next(c for c in plan["cells"] if c["id"] == cid)
        n = confirm_problems(plan, resolved_arm(plan, cell, "treatment"))
        cells[cid] = cell_power(paired_matrix(t, b), n, int(plan["k"]), float(plan["test"]["alpha"]),
                                int(plan["test"]["m"]), power, (t.run_id, b.run_id))
    return power_record(cells, bound_pp, allowed), underpowered(cells, bound_pp)


def plan_wall_time(plan: dict, slots: int, splits_dir=None) -> dict:
    """The predicted wall time of the plan's confirmation on this host (module doc), measured once
    per model on the first dev problem."""
    problems = load_split("dev", splits_dir=splits_dir)
    cells, measured = {}, {}
    for cell in plan["cells"]:
        arms = [resolved_arm(plan, cell, arm) for arm in ARMS]
        if cell["model"] not in measured:
            line, fill, figures, load = measure_host(cell["model"], str(arms[0].get("dtype", "float32")), slots,
                                                     problems, int(plan["max_new_tokens"]))
            measured[cell["model"]] = (line, fill, dict(figures, load_seconds=load))
        line, fill, figures = measured[cell["model"]]
        evicting = sum(a.get("budget") is not None for a in arms)
        sequences = confirm_problems(plan, arms[0]) * int(plan["k"])
        cells[cell["id"]] = confirm_seconds(sequences, int(plan["max_new_tokens"]), slots, evicting,
                                            len(arms) - evicting, line, fill, figures["load_seconds"])
    return {"host": platform.node(), "slots": slots, "pessimistic": "every answer runs to max_new_tokens",
            "measured": {m: f for m, (_, _, f) in measured.items()}, "cells_seconds": cells,
            "total_seconds": sum(cells.values())}


def with_power(plan: dict, dev_paths, target_power, bound, allowed, slots, splits_dir) -> tuple[dict, list[str]]:
    """The plan with its "power" record (each cell's MDE from the dev runs, the predicted wall time when
    measured) and the cells above the bound that the user did not allow; unchanged without --dev
    and --time-slots."""
    if not dev_paths and slots is None:
        return plan, []
    refused: list[str] = []
    if dev_paths:
        runs = [load_run(p) for p in find_run_dirs(dev_paths)]
        record, above = plan_power(plan, runs, target_power, bound, allowed)
        refused = [] if allowed else above
    else:
        record = power_record({}, bound, allowed)
    if slots is not None:
        record["wall_time"] = plan_wall_time(plan, slots, splits_dir)
    return dict(plan, power=record), refused
