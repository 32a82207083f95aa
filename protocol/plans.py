"""Plans: building, writing and loading a pre-registration, and the identity of its cells.

A plan file is `{"plan_hash": sha256(canonical_json(plan)), "registered_at": ..., "plan": {...}}`,
named `plan-<hash[:12]>.json` when written into a directory (`protocol.prereg` describes the whole
protocol). Writing a plan registers it in the user-level registry (`protocol.ledger.Registry`).

A *cell* of a plan is one (model, budget) comparison. Its identity (`cell_identity`) is what the
comparison is about: the model and its revision, the budget and each arm's accounting, the dataset
and its split manifest, and both arm configurations, each with the sha256 of the calibration
statistics it resolves to for that cell. The plan's seed, note, k, token limit and test are not part
of it, nor are settings that say how or how much is run rather than what is compared (device,
engine, dtype, limit, the data file's path, fidelity diagnostics). Two plans with the same cell
identity test the same hypothesis on the same held-out problems: the second one is refused unless
it names the first (`supersedes`) with a reason.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Iterable
from pathlib import Path

from protocol.data import AIME_PROBLEMS, DATASETS
from protocol.errors import ProtocolError
from protocol.io import canonical_json, dumps, ensure_dir, load_json, load_json_object, sha256_text, write_atomic
from protocol.ledger import Registry
from protocol.numbers import identity_number
from protocol.splits import COUNTS

PLAN_SCHEMA = "retention.plan/1"
# Version of the run-configuration schema a plan was registered against. The runtime may pass its
# own value to `confirm`; a mismatch means the registered configuration no longer means the same.
CONFIG_SCHEMA_VERSION = 1
ARMS = ("baseline", "treatment")
# Keys fixed per cell or by the plan; an arm configuration may not set them itself.
_PLAN_LEVEL_KEYS = {"model", "budget", "samples", "seed", "max_new_tokens", "split", "plan_hash"}
DEFAULT_DATASET = "math500"
# The built-in generation runner: the one a plan runs with when it registers none.
DEFAULT_RUNNER_SPEC = "retention.runs.jobs:confirm_runner"
_RUNNER_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

# Arm keys that say how or how much is run, not what is compared: not part of a cell's identity.
# The sampler only changes which random draws are made (as the seed does, which is not part of it
# either): a cell confirmed again with another sampler would be a second look at the confirm set.
_EXECUTION_KEYS = {"device", "engine", "dtype", "limit", "data", "fidelity", "sampler"}
# Defaults of the run configuration (retention.runs.arms.validate_arm): a key at its default is the
# same arm whether it is written or not.
_ARM_DEFAULTS = {"accounting": "mean", "temperature": 0.6, "top_p": 0.95, "ignore_eos": False,
                 "protect_prompt": False, "interval": None, "sink": None, "recent": None}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------------
# Building a plan


def cell_id(model: str, budget: int | None) -> str:
    """Stable, file-name-safe identifier of a (model, budget) cell."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model)
    return f"{safe}@{'full' if budget is None else f'b{budget}'}"


def _check_arm(name: str, cfg) -> dict:
    if not isinstance(cfg, dict) or not cfg.get("scorer"):
        raise ProtocolError(f"the {name} configuration must be a JSON object with a 'scorer'")
    clash = sorted(_PLAN_LEVEL_KEYS & cfg.keys())
    if clash:
        raise ProtocolError(f"the {name} configuration sets plan-level key(s) {clash}; "
                            "give them as plan options instead")
    canonical_json(cfg)
    return cfg


def _confirm_problems(dataset: str) -> int | None:
    """Problems in the confirm split of the dataset (None when this module does not know it)."""
    if dataset == DEFAULT_DATASET:
        return COUNTS["confirm"]
    return AIME_PROBLEMS if dataset in DATASETS else None  # an AIME set is confirmed whole


def _check_pairs(treatment: dict, baseline: dict, n_confirm: int | None) -> None:
    """Refuse arms that `confirm` could not pair: both arms must run the same problems (the first
    `limit` of the confirm split), at least 2 of them (a clustered standard error needs 2)."""
    counts = {}
    for name, arm in (("treatment", treatment), ("baseline", baseline)):
        limit = arm.get("limit")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ProtocolError(f"the {name} limit must be a positive integer, got {limit!r}")
        counts[name] = limit if n_confirm is None else min(limit or n_confirm, n_confirm)
    t, b = counts["treatment"], counts["baseline"]
    if t != b:
        raise ProtocolError(f"the arms would not be paired: the treatment runs the first "
                            f"{t or 'all'} confirm problems, the baseline the first {b or 'all'}; "
                            "give both arms the same limit")
    if t is not None and t < 2:
        raise ProtocolError(f"each cell would have {t} problem(s) on the confirm split; the paired "
                            "test needs at least 2 (raise the limit)")


def build_plan(*, models: Iterable[str], budgets: Iterable[int | None], treatment: dict,
               baseline: dict, k: int, seed: int, max_new_tokens: int, manifest_hash: str,
               code_version: str, boot: int = 100_000, boot_max: int = 1_000_000,
               boot_seed: int = 0, alpha: float = 0.05, m: int | None = None,
               test: str = "cluster-bootstrap", config_schema: int = CONFIG_SCHEMA_VERSION,
               model_revisions: dict | None = None, note: str | None = None,
               dataset: str = DEFAULT_DATASET, runner: str | None = None,
               supersedes: Iterable[str] | None = None, reason: str | None = None,
               n_confirm: int | None = None, runner_sources: dict | None = None,
               model_contents: dict | None = None) -> dict:
    """The plan body (the part that is hashed); cells are the product models x budgets.

    dataset: stored only when not the default (math500). runner: a registered MODULE:FUNCTION
    generation runner (None: the built-in one); runner_sources: {file: sha256} of its code, stored
    with it so that a changed runner can be refused at confirm. supersedes: hashes (or prefixes of at least 12
    hex digits) of plans that already confirmed or started cells of this one, with the `reason`.
    n_confirm: problems in the confirm split (default: known for math500), to refuse limits that
    leave a cell without pairs. model_contents: {model: sha256 of its weights and configuration} for
    models named by path, which a cell's identity names by content (module docstring)."""
    models = list(dict.fromkeys(models))
    budgets = list(dict.fromkeys(budgets))
    if not models or not budgets:
        raise ProtocolError("a plan needs at least one model and one budget")
    for b in budgets:
        if b is not None and (not isinstance(b, int) or b <= 0):
            raise ProtocolError(f"budget must be a positive integer or 'full', got {b!r}")
    cells = [{"id": cell_id(mo, b), "model": mo, "budget": b} for mo in models for b in budgets]
    if len({c["id"] for c in cells}) != len(cells):
        raise ProtocolError("two cells map to the same identifier; rename a model")
    m = len(cells) if m is None else int(m)
    if m < len(cells):
        raise ProtocolError(f"m = {m} is smaller than the number of cells ({len(cells)})")
    if k < 1 or max_new_tokens < 1 or boot < 1:
        raise ProtocolError("k, max_new_tokens and B must be positive")
    if not 0.0 < alpha < 1.0:
        raise ProtocolError(f"alpha must be in (0, 1), got {alpha}")
    if test != "cluster-bootstrap":
        raise ProtocolError(f"unknown test {test!r} (supported: cluster-bootstrap)")
    if not re.fullmatch(r"[0-9a-f]{64}", manifest_hash or ""):
        raise ProtocolError(f"split manifest hash must be 64 hex digits, got {manifest_hash!r}")
    treatment, baseline = _check_arm("treatment", treatment), _check_arm("baseline", baseline)
    if canonical_json(treatment) == canonical_json(baseline):
        raise ProtocolError("treatment and baseline configurations are identical")
    if not isinstance(dataset, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", dataset):
        raise ProtocolError(f"dataset must be a name, got {dataset!r}")
    _check_pairs(treatment, baseline, n_confirm if n_confirm is not None else _confirm_problems(dataset))
    unknown = sorted(set(model_revisions or {}) - set(models))
    if unknown:
        raise ProtocolError(f"model revision given for a model not in the plan: {unknown}")
    if runner is not None and not _RUNNER_SPEC.fullmatch(runner):
        raise ProtocolError(f"runner must be MODULE:FUNCTION, got {runner!r}")
    supersedes = list(dict.fromkeys(supersedes or ()))
    bad = [s for s in supersedes if not re.fullmatch(r"[0-9a-f]{12,64}", s)]
    if bad:
        raise ProtocolError(f"supersedes: {bad} are not plan hashes (12 to 64 lowercase hex digits)")
    if bool(supersedes) != bool(reason and reason.strip()):
        raise ProtocolError("superseding a confirmed plan needs both the plan hash(es) and a reason")
    plan = {
        "schema": PLAN_SCHEMA,
        "cells": cells,
        "treatment": treatment,
        "baseline": baseline,
        "k": int(k),
        "seed": int(seed),
        "max_new_tokens": int(max_new_tokens),
        "split": "confirm",
        "test": {"name": test, "boot": int(boot), "boot_max": int(max(boot, boot_max)),
                 "boot_seed": int(boot_seed), "alpha": float(alpha), "m": m,
                 "correction": "bonferroni", "secondary": ["holm", "clustered-z", "sign-flip"]},
        "split_manifest_sha256": manifest_hash,
        "config_schema": int(config_schema),
        "code_version": code_version,
        "model_revisions": dict(model_revisions or {}),
    }
    if dataset != DEFAULT_DATASET:
        plan["dataset"] = dataset
    if model_contents:
        unknown = sorted(set(model_contents) - set(models))
        if unknown:
            raise ProtocolError(f"model content given for a model not in the plan: {unknown}")
        plan["model_contents"] = dict(model_contents)
    if runner is not None:
        plan["runner"] = runner
        if runner_sources:
            plan["runner_sources"] = dict(runner_sources)
    if supersedes:
        plan["supersedes"] = {"plans": supersedes, "reason": reason.strip()}
    if note:
        plan["note"] = note
    return plan


def with_cell_stats(plan: dict, resolved: dict[str, dict[str, str | None]]) -> dict:
    """The plan with each cell's calibration statistics recorded by content:
    cell["stats_sha256"] = {"treatment": sha256 or None, "baseline": ...}, as
    `retention.runs.arms.validate_plan` resolves them (each model of a study has its own)."""
    plan = json.loads(canonical_json(plan))
    for cell in plan["cells"]:
        got = resolved.get(cell["id"], {})
        cell["stats_sha256"] = {arm: got.get(arm) for arm in ARMS}
    return plan


def plan_hash(plan: dict) -> str:
    return sha256_text(canonical_json(plan))


# --------------------------------------------------------------------------------------------------
# Cell identity and the one-confirmation-per-cell rule


def _numbers(x):
    """Numbers as floats at the compared precision (1 and 1.0, -0.0 and 0.0, 0.7 and
    0.7000000000000001 are the same setting: `protocol.numbers`), recursively."""
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return identity_number(x)
    return x


def _arm_identity(arm: dict, stats_sha256: str | None) -> dict:
    out = {}
    for key, value in arm.items():
        if key in _EXECUTION_KEYS or key in ("accounting", "stats_sha256"):
            continue
        if key in _ARM_DEFAULTS and _numbers(value) == _numbers(_ARM_DEFAULTS[key]):
            continue
        out[key] = value
    _plugins_by_code(out)
    params = dict(out.get("scorer_params") or {})
    params.pop("stats", None)  # a path: the statistics are identified by their sha256 below
    out["scorer_params"] = params
    out["stats_sha256"] = stats_sha256 or arm.get("stats_sha256")
    return _numbers(out)


def _plugins_by_code(arm: dict) -> None:
    """Name every plugin of an arm by what it runs (its identity's `code_sha256`) rather than by how
    it was named (an entry point, `module:Class`, a file path): one plugin under two names is one
    cell. Identities without the key (registered before it) keep their names."""
    plugin = arm.get("scorer_plugin")
    if isinstance(plugin, dict) and plugin.get("code_sha256"):
        arm["scorer"] = f"code:{plugin['code_sha256']}"
        arm["scorer_plugin"] = {"code_sha256": plugin["code_sha256"]}
    for key, value in list(arm.items()):
        mech = value.get("plugin") if isinstance(value, dict) else None
        if isinstance(mech, dict) and mech.get("code_sha256"):
            arm[key] = dict(value, name=f"code:{mech['code_sha256']}", plugin={"code_sha256": mech["code_sha256"]})


def cell_identity(plan: dict, cell: dict) -> dict:
    """What a cell compares (module docstring): equal identities are the same hypothesis."""
    stats = cell.get("stats_sha256") or {}
    # A model a plan names by path is the content of its weights and configuration (a copied folder
    # is the same model): `model_contents` pins it (absent in plans written before, which keep their keys).
    content = (plan.get("model_contents") or {}).get(cell["model"])
    return {
        "model": f"content:{content}" if content else cell["model"],
        "model_revision": (plan.get("model_revisions") or {}).get(cell["model"]),
        "budget": cell["budget"],
        "accounting": {arm: plan[arm].get("accounting", "mean") for arm in ARMS},
        "dataset": plan.get("dataset", DEFAULT_DATASET),
        "split": plan.get("split", "confirm"),
        "split_manifest_sha256": plan["split_manifest_sha256"],
        "treatment": _arm_identity(plan["treatment"], stats.get("treatment")),
        "baseline": _arm_identity(plan["baseline"], stats.get("baseline")),
    }


def cell_key(identity: dict) -> str:
    """sha256 of the canonical JSON of a cell identity: the name of its registry file."""
    return sha256_text(canonical_json(identity))


def superseded_plans(plan: dict, attempts: list[dict]) -> list[str]:
    """The plans (full hashes) among `attempts` that the plan names in its `supersedes`."""
    names = (plan.get("supersedes") or {}).get("plans") or []
    return sorted({a["plan_hash"] for a in attempts
                   if any(a["plan_hash"].startswith(s) for s in names)})


def check_repeats(plan: dict, h: str, registry: Registry, cells: Iterable[str] | None = None,
                  *, require_match: bool = False) -> dict[str, tuple[str, list[str]]]:
    """Refuse a plan whose cells another plan has already confirmed or started, unless it names
    that plan in `supersedes`. Returns {cell id: (cell key, superseded plan hashes)}.

    cells: the cell ids to check (default: all). require_match: also refuse a `supersedes` entry
    that names no plan with an attempt on these cells (a typo, checked at registration)."""
    wanted = set(cells) if cells is not None else None
    out, problems, matched = {}, [], set()
    names = (plan.get("supersedes") or {}).get("plans") or []
    for cell in plan["cells"]:
        if wanted is not None and cell["id"] not in wanted:
            continue
        key = cell_key(cell_identity(plan, cell))
        others = [a for a in registry.cell_attempts(key) if a["plan_hash"] != h]
        covered = superseded_plans(plan, others)
        matched |= {s for s in names for p in covered if p.startswith(s)}
        for p in dict.fromkeys(a["plan_hash"] for a in others):
            if p in covered:
                continue
            mine = [a for a in others if a["plan_hash"] == p]
            done = [a for a in mine if a["status"] == "confirmed"]
            what = (f"confirmed under plan {p[:12]} (in {done[-1]['out_dir']})" if done else
                    f"started, not finished, under plan {p[:12]} (in {mine[-1]['out_dir']})")
            problems.append(f"cell {cell['id']} was already {what}")
        out[cell["id"]] = (key, covered)
    unused = [s for s in names if s not in matched]
    if require_match and unused:
        raise ProtocolError(f"--supersedes {', '.join(unused)}: no plan with that hash confirmed or "
                            f"started a cell of this plan in {registry.root}")
    if problems:
        raise ProtocolError("; ".join(problems) + ". One confirmation per cell: a repeat is refused "
                            "unless the plan says so (preregister --supersedes PLAN --reason ...)")
    return out


# --------------------------------------------------------------------------------------------------
# Plan files


def write_plan(plan: dict, out: Path, registry: Registry | None = None) -> tuple[Path, str, bool]:
    """Write the plan to `out`: a directory (existing, or a new path without a `.json` suffix)
    gets `plan-<hash12>.json`; any other path is the plan file itself.

    Returns (path, hash, written). An existing identical plan is left untouched (written=False,
    keeping its registration time); an existing different plan is never overwritten. A plan whose
    cells another plan already confirmed or started is refused (`check_repeats`).
    """
    h = plan_hash(plan)
    registry = registry or Registry()
    check_repeats(plan, h, registry, require_match=True)
    out = Path(out)
    as_dir = out.is_dir() or (not out.exists() and out.suffix.lower() != ".json")
    path = out / f"plan-{h[:12]}.json" if as_dir else out
    if path.exists():
        try:
            existing = load_json_object(path, "plan file")
            same = existing.get("plan_hash") == h and plan_hash(existing.get("plan")) == h
        except (AttributeError, ProtocolError):
            same = False
        if not same:
            raise ProtocolError(f"{path} already holds a different plan; refusing to overwrite it")
        registry.register(h)
        return path, h, False
    ensure_dir(path.parent, "plan folder")
    registry.register(h)  # the key that chains every ledger line of this plan
    doc = {"plan_hash": h, "registered_at": _now(), "plan": plan}
    write_atomic(path, dumps(doc, indent=2, sort_keys=True) + "\n")
    return path, h, True


def load_plan(path: Path) -> tuple[dict, str]:
    """Read a plan file and verify it: the body must hash to the stored hash, and a file named
    `plan-<prefix>.json` must carry a hash with that prefix. Returns (plan, hash)."""
    path = Path(path)
    try:
        doc = load_json(path, "plan file")
    except ProtocolError as exc:
        raise ProtocolError(f"not a plan file: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("plan"), dict):
        raise ProtocolError(f"{path}: not a plan file (no 'plan' object)")
    stored, actual = doc.get("plan_hash"), plan_hash(doc["plan"])
    if stored != actual:
        raise ProtocolError(f"{path}: plan content does not match its registered hash "
                            f"({str(stored)[:12]} registered, {actual[:12]} now): edited after "
                            "registration")
    match = re.fullmatch(r"plan-([0-9a-f]{6,64})\.json", path.name)
    if match and not actual.startswith(match.group(1)):
        raise ProtocolError(f"{path}: file name does not match the plan hash {actual[:12]}")
    if doc["plan"].get("schema") != PLAN_SCHEMA:
        raise ProtocolError(f"{path}: unknown plan schema {doc['plan'].get('schema')!r}")
    return doc["plan"], actual


# --------------------------------------------------------------------------------------------------
# Arm configurations


def arm_config(plan: dict, plan_h: str, cell: dict, arm: str, overrides: dict | None = None) -> dict:
    """The complete configuration a runner must use for one arm of one cell."""
    cfg = json.loads(canonical_json(plan[arm]))  # deep copy
    cfg.update({"model": cell["model"], "budget": cell["budget"], "samples": plan["k"],
                "seed": plan["seed"], "max_new_tokens": plan["max_new_tokens"],
                "split": "confirm", "plan_hash": plan_h})
    revision = plan.get("model_revisions", {}).get(cell["model"])
    if revision:
        cfg["model_revision"] = revision
    if plan.get("dataset", DEFAULT_DATASET) != DEFAULT_DATASET:
        cfg["dataset"] = plan["dataset"]
    stats = (cell.get("stats_sha256") or {}).get(arm)
    if stats:  # the statistics this cell registered: a changed file is refused before running
        cfg["stats_sha256"] = stats
    for key, value in (overrides or {}).items():
        _set_dotted(cfg, key, value)
    return cfg


def _set_dotted(cfg: dict, key: str, value) -> None:
    parts = key.split(".")
    if not all(parts):
        raise ProtocolError(f"override {key!r}: not a dotted key")
    node = cfg
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ProtocolError(f"override {key!r}: {part!r} is not an object")
    node[parts[-1]] = value
