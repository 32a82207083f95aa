"""Pre-registration, confirmation and the append-only ledger (protocol section 5).

A *plan* fixes, before any confirm-split result exists, the cells (model x budget), the treatment
and baseline configurations, k, the seed, the max-token limit, the test (B, alpha, m), the split
manifest hash, the configuration schema version and the code version. The plan file is

    {"plan_hash": sha256(canonical_json(plan)), "registered_at": ..., "plan": {...}}

and is named `plan-<hash[:12]>.json` when written into a directory, so the hash names it.

Writing a plan registers it in the user-level registry (`protocol.ledger`): a key is created under
its hash. `confirm` runs exactly the plan's cells on the `confirm` split through an injected runner
and records each finished cell in three HMAC-keyed, write-ahead hash chains: the registry's (the
commit point, keyed by plan hash, so `--out`, the working directory and the plan's file name do not
matter), one beside the plan and one in the confirm directory (`ledger.jsonl`, which `report`
reads); irregularities go to `deviations.jsonl`. A cell in any verified ledger is confirmed, and a
second confirmation of it is refused wherever it is attempted.

The runner contract (the real generation runner is plugged in by the CLI layer):

    runner(cell: dict, arm: str, arm_config: dict, out_dir: Path) -> Path

* `cell` = {"id", "model", "budget"}; `arm` is "baseline" or "treatment";
* `arm_config` is the complete run configuration to use (the plan's arm configuration plus model,
  budget, samples=k, seed, max_new_tokens, split="confirm", plan_hash, and any declared overrides);
* `out_dir` is where to create the run directory (`<confirm out>/runs/<cell id>/`);
* it returns a run directory holding `config.json` and `records.jsonl` (docs/records.md) and raises
  on failure (the crash is logged as a deviation and the cell can be rerun). A `ProtocolError`
  means bad input (a file, an option) and is raised as is, never logged as a crash.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from protocol import report, stats
from protocol.errors import ProtocolError
from protocol.io import (canonical_json, dumps, ensure_dir, exclusive_lock, load_json, load_json_object,
                         sha256_file, sha256_text, write_atomic)
from protocol.ledger import (GENESIS, STATE_ENV, HashChain, Registry, deviations_path, ledger_path,
                             plan_ledger_path, plan_of_chain, read_confirmation)

PLAN_SCHEMA = "retention.plan/1"
# Version of the run-configuration schema a plan was registered against. The runtime may pass its
# own value to `confirm`; a mismatch means the registered configuration no longer means the same.
CONFIG_SCHEMA_VERSION = 1
ARMS = ("baseline", "treatment")
# Keys fixed per cell or by the plan; an arm configuration may not set them itself.
_PLAN_LEVEL_KEYS = {"model", "budget", "samples", "seed", "max_new_tokens", "split", "plan_hash"}

Runner = Callable[[dict, str, dict, Path], Path]
# Hook for the CLI layer: `retention` sets this to its generation runner; `confirm` uses it when no
# runner is passed explicitly.
DEFAULT_RUNNER: Runner | None = None


# --------------------------------------------------------------------------------------------------
# Time stamps


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------------
# Plans


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


def build_plan(*, models: Iterable[str], budgets: Iterable[int | None], treatment: dict,
               baseline: dict, k: int, seed: int, max_new_tokens: int, manifest_hash: str,
               code_version: str, boot: int = 100_000, boot_max: int = 1_000_000,
               boot_seed: int = 0, alpha: float = 0.05, m: int | None = None,
               test: str = "cluster-bootstrap", config_schema: int = CONFIG_SCHEMA_VERSION,
               model_revisions: dict | None = None, note: str | None = None) -> dict:
    """The plan body (the part that is hashed); cells are the product models x budgets."""
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
    unknown = sorted(set(model_revisions or {}) - set(models))
    if unknown:
        raise ProtocolError(f"model revision given for a model not in the plan: {unknown}")
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
    if note:
        plan["note"] = note
    return plan


def plan_hash(plan: dict) -> str:
    return sha256_text(canonical_json(plan))


def write_plan(plan: dict, out: Path, registry: Registry | None = None) -> tuple[Path, str, bool]:
    """Write the plan to `out`: a directory (existing, or a new path without a `.json` suffix)
    gets `plan-<hash12>.json`; any other path is the plan file itself.

    Returns (path, hash, written). An existing identical plan is left untouched (written=False,
    keeping its registration time); an existing different plan is never overwritten.
    """
    h = plan_hash(plan)
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
        (registry or Registry()).register(h)
        return path, h, False
    ensure_dir(path.parent, "plan folder")
    registry = registry or Registry()
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
# Confirmation


def _current_manifest_hash() -> str:
    try:
        from protocol.splits import manifest_sha256
    except ImportError as exc:
        raise ProtocolError(f"cannot read the split manifest ({exc}); pass its hash explicitly") from None
    return manifest_sha256(splits_dir=None)


def arm_config(plan: dict, plan_h: str, cell: dict, arm: str, overrides: dict | None = None) -> dict:
    """The complete configuration a runner must use for one arm of one cell."""
    cfg = json.loads(canonical_json(plan[arm]))  # deep copy
    cfg.update({"model": cell["model"], "budget": cell["budget"], "samples": plan["k"],
                "seed": plan["seed"], "max_new_tokens": plan["max_new_tokens"],
                "split": "confirm", "plan_hash": plan_h})
    revision = plan.get("model_revisions", {}).get(cell["model"])
    if revision:
        cfg["model_revision"] = revision
    for key, value in (overrides or {}).items():
        _set_dotted(cfg, key, value)
    return cfg


def _set_dotted(cfg: dict, key: str, value) -> None:
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ProtocolError(f"override {key!r}: {part!r} is not an object")
    node[parts[-1]] = value


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _mismatches(expected: dict, actual: dict, prefix: str = "") -> list[dict]:
    """Keys of `expected` whose value differs in `actual` (nested dicts compared key by key)."""
    out = []
    for key, want in expected.items():
        if key in ("plan_hash",):
            continue
        got = actual.get(key, "<absent>")
        if isinstance(want, dict) and isinstance(got, dict):
            out += _mismatches(want, got, f"{prefix}{key}.")
        elif _is_number(want) and _is_number(got):
            if want != got:  # 0 planned and 0.0 recorded are the same setting
                out.append({"field": prefix + key, "planned": want, "actual": got})
        elif canonical_json(want) != canonical_json(got):
            out.append({"field": prefix + key, "planned": want, "actual": got})
    return out


def _read_run_config(run_dir: Path) -> dict:
    try:
        return load_json_object(Path(run_dir) / "config.json", "run configuration")
    except ProtocolError as exc:
        raise ProtocolError(f"runner returned {run_dir} without a readable config.json ({exc})") from None


def confirm(plan_path: Path, out_dir: Path, runner: Runner | None = None, *,
            manifest_hash: str | None = None, code_version: str | None = None,
            config_schema: int = CONFIG_SCHEMA_VERSION, cells: Iterable[str] | None = None,
            overrides: dict | None = None, reason: str | None = None, grade=None,
            validate: Callable[[dict], None] | None = None, registry: Registry | None = None,
            log: Callable[[str], None] | None = None) -> list[dict]:
    """Run the plan's cells on the confirm split and record each finished cell, once per plan.

    plan_path: a registered plan file; out_dir: the confirmation directory (ledger.jsonl,
    deviations.jsonl, runs/<cell>/...). runner: see the module docstring (defaults to
    DEFAULT_RUNNER). manifest_hash: the current split manifest hash (default: read through
    protocol.splits). cells: ids to run (default: every cell not yet confirmed); naming an already
    confirmed cell is refused, whichever directory confirmed it. overrides: {dotted key: value}
    changes to the registered configuration, allowed only with a `reason` and logged as
    deviations. grade: passed to the record loader for records without a verdict. validate:
    called with every arm configuration before anything runs; what it raises is an input error,
    never a crash deviation (so is a `ProtocolError` raised by the runner). registry: the
    user-level registry (default: `protocol.ledger.Registry()`). Returns the entries written.
    """
    say = log or (lambda _msg: None)
    runner = runner or DEFAULT_RUNNER
    if runner is None:
        raise ProtocolError("no generation runner is installed for confirm")
    plan_path = Path(plan_path)
    plan, h = load_plan(plan_path)
    current_manifest = manifest_hash or _current_manifest_hash()
    if current_manifest != plan["split_manifest_sha256"]:
        raise ProtocolError(f"split manifest {current_manifest[:12]} differs from the registered "
                            f"{plan['split_manifest_sha256'][:12]}: refusing to confirm")
    if int(config_schema) != plan["config_schema"]:
        raise ProtocolError(f"configuration schema {config_schema} differs from the registered "
                            f"{plan['config_schema']}: refusing to confirm")
    if overrides and not reason:
        raise ProtocolError("overriding the registered configuration needs a reason (deviation log)")
    bad = sorted(k for k in overrides or {} if k.split(".")[0] in {"split", "plan_hash", "model", "budget"})
    if bad:
        raise ProtocolError(f"cannot override {bad}: they define what is being confirmed")
    code_version = code_version or "unknown"
    registry = registry or Registry()
    by_id = {c["id"]: c for c in plan["cells"]}
    wanted = None
    if cells is not None:
        wanted = list(dict.fromkeys(cells))
        unknown = [c for c in wanted if c not in by_id]
        if unknown:
            raise ProtocolError(f"cell(s) {unknown} are not in plan {h[:12]}")
    if validate is not None:  # input errors surface here, before any generation
        for cell in (by_id[c] for c in wanted or by_id):
            for arm in ARMS:
                validate(arm_config(plan, h, cell, arm, overrides))

    out_dir = ensure_dir(Path(out_dir), "confirm directory")
    with registry.lock(h), exclusive_lock(out_dir / ".confirm.lock", "confirm"):
        books = _Books.open(registry, h, plan_path, out_dir)
        done = books.sync()
        if wanted is not None:
            again = [c for c in wanted if c in done]
            if again:
                where = sorted({done[c].get("out_dir", "?") for c in again})
                raise ProtocolError(f"cell(s) {again} of plan {h[:12]} already confirmed (in "
                                    f"{', '.join(where)}); a second confirmation is refused")
        else:
            wanted = [c for c in by_id if c not in done]
            if not wanted:
                raise ProtocolError(f"all {len(by_id)} cells of plan {h[:12]} are already confirmed")
            if done:
                say(f"already confirmed, not rerun: {', '.join(sorted(done))}")

        # Sidecars are written only after the ledger entry: one without its entry means the
        # ledgers lost lines (or were deleted), and a second confirmation must not slip through.
        orphans = [c for c in wanted if any((out_dir / "runs" / c).rglob("confirm.json"))]
        if orphans:
            raise ProtocolError(f"cell(s) {orphans} carry confirm.json sidecars but are missing "
                                f"from every ledger of plan {h[:12]}: the ledgers were truncated or replaced")
        deviations = books.devlog.entries()

        def deviate(kind: str, cell: str | None, detail: dict) -> str:
            entry = books.devlog.append({"kind": kind, "cell_id": cell, "plan_hash": h,
                                         "code_version": code_version, "at": _now(), **detail})
            say(f"deviation ({kind}) {cell or ''}: {dumps(detail, sort_keys=True)}")
            return entry["hash"]

        written = []
        for cid in wanted:
            cell = by_id[cid]
            dev_ids = []
            if code_version != plan["code_version"]:
                dev_ids.append(deviate("code_version", cid, {"planned": plan["code_version"],
                                                             "actual": code_version}))
            if any(d.get("kind") == "crash" and d.get("cell_id") == cid for d in deviations):
                dev_ids.append(deviate("rerun_after_crash", cid, {}))
            for key, value in (overrides or {}).items():
                dev_ids.append(deviate("override", cid, {"field": key, "value": value,
                                                         "reason": reason}))
            runs = {}
            for arm in ARMS:
                cfg = arm_config(plan, h, cell, arm, overrides)
                say(f"{cid}: running {arm} ({cfg.get('scorer')})")
                try:
                    run_dir = Path(runner(dict(cell), arm, cfg, out_dir / "runs" / cid))
                except ProtocolError:
                    raise  # bad input (a file, an option): an error to fix, not a crash
                except Exception as exc:  # noqa: BLE001 - any other runner failure is a logged deviation
                    deviate("crash", cid, {"arm": arm, "error": f"{type(exc).__name__}: {exc}"})
                    raise ProtocolError(f"{cid} {arm} crashed ({type(exc).__name__}: {exc}); "
                                        "logged as a deviation, rerun confirm to resume") from exc
                meta = _read_run_config(run_dir)
                actual = meta.get("config", {})
                if actual.get("split") != "confirm":
                    deviate("invalid_run", cid, {"arm": arm, "split": actual.get("split")})
                    raise ProtocolError(f"{run_dir} did not run on the confirm split "
                                        f"(split={actual.get('split')!r})")
                for mm in _mismatches(cfg, actual):
                    dev_ids.append(deviate("config_mismatch", cid, {"arm": arm, **mm}))
                runs[arm] = (run_dir, meta)
            entry = _finish_cell(plan, h, cell, runs, out_dir, code_version, grade, deviate, dev_ids)
            entry = books.commit(entry)
            say(f"{cid}: confirmed, d = {100 * entry['result']['estimate']:+.2f} pp, "
                f"p = {entry['result']['p_bootstrap']:.4g} ({entry['result']['verdict']})")
            written.append(entry)
        return written


def _content(entry: dict) -> dict:
    """An entry without its chain fields: what the registry and every copy agree on."""
    return {k: v for k, v in entry.items() if k not in ("prev", "hash")}


class _Books:
    """The three ledgers of one plan and the deviation log of one confirm directory.

    The registry ledger is written first (the commit point of a confirmation); the copy beside
    the plan, the confirm directory's copy and the run sidecars follow, and `sync` re-creates
    whatever a kill left out, from any verified copy.
    """

    def __init__(self, h: str, key: bytes, plan_path: Path, out_dir: Path, registry: Registry):
        self.h, self.out_dir, self.out_id = h, out_dir, str(out_dir.resolve())
        self.registry = HashChain(registry.plan_dir(h) / "ledger.jsonl", key)
        self.beside = HashChain(plan_ledger_path(plan_path), key)
        self.local = HashChain(ledger_path(out_dir), key)
        self.devlog = HashChain(deviations_path(out_dir), key)

    @classmethod
    def open(cls, registry: Registry, h: str, plan_path: Path, out_dir: Path) -> "_Books":
        for log in (ledger_path(out_dir), deviations_path(out_dir)):
            other = plan_of_chain(log)
            if other not in (None, h):
                raise ProtocolError(f"{log} belongs to another plan ({other[:12]}); use a separate "
                                    "confirm directory per plan")
        key = registry.key(h)
        if key is None:
            copies = [p for p in (plan_ledger_path(plan_path), ledger_path(out_dir),
                                  deviations_path(out_dir)) if p.exists()]
            if copies:
                raise ProtocolError(f"plan {h[:12]} has ledgers ({', '.join(map(str, copies))}) but is not "
                                    f"registered in {registry.root}: they cannot be verified, so confirm "
                                    f"refuses (set ${STATE_ENV} to the registry it was registered in)")
            key = registry.register(h)  # a plan written before registries existed, or copied here
        return cls(h, key, plan_path, out_dir, registry)

    def sync(self) -> dict[str, dict]:
        """Verify every ledger, complete what a kill interrupted; returns {cell id: content}."""
        chains = {"registry": self.registry.entries(), "beside": self.beside.entries(),
                  "local": self.local.entries()}
        self.devlog.entries()
        done: dict[str, dict] = {}
        for entries in chains.values():
            for e in entries:
                if e.get("kind") == "cell":
                    done.setdefault(e["cell_id"], _content(e))
        for content in done.values():
            self._copy(content, chains)
        return done

    def _copy(self, content: dict, chains: dict) -> None:
        have = lambda name: any(e.get("cell_id") == content["cell_id"] for e in chains[name])  # noqa: E731
        if not have("registry"):
            self.registry.append(content)
        if not have("beside"):
            self.beside.append(content)
        if content.get("out_dir") == self.out_id:
            entry = (next((e for e in chains["local"] if e.get("cell_id") == content["cell_id"]), None)
                     or self.local.append(content))
            self._sidecars(entry)

    def commit(self, entry: dict) -> dict:
        entry = {**entry, "out_dir": self.out_id}
        committed = self.registry.append(entry)  # the confirmation exists from here on
        content = _content(committed)
        self.beside.append(content)
        local = self.local.append(content)
        self._sidecars(local)
        return local

    def _sidecars(self, entry: dict) -> None:
        for arm, info in entry["runs"].items():
            run_dir = Path(info["path"])
            run_dir = run_dir if run_dir.is_absolute() else self.out_dir / run_dir
            sidecar = {"plan_hash": self.h, "cell_id": entry["cell_id"], "arm": arm,
                       "code_version": entry.get("code_version"),
                       "model_revision": (entry.get("model_revisions") or {}).get(arm),
                       "ledger_entry": entry["hash"], "records_sha256": info["records_sha256"]}
            path = run_dir / "confirm.json"
            if not path.exists() or load_json_object(path, "confirmation sidecar") != sidecar:
                write_atomic(path, dumps(sidecar, indent=2) + "\n")


def _portable(run_dir: Path, base: Path) -> str:
    """A run path relative to the confirm directory when inside it, so the tree can be moved."""
    path = Path(run_dir).resolve()
    try:
        return str(path.relative_to(Path(base).resolve()))
    except ValueError:
        return str(path)


def _finish_cell(plan, h, cell, runs, out_dir, code_version, grade, deviate, dev_ids) -> dict:
    """Pair the two arms, run the registered test and build the ledger entry of one cell."""
    loaded = {arm: report.load_run(run_dir, grade=grade) for arm, (run_dir, _m) in runs.items()}
    data = report.pair_runs(loaded["treatment"], loaded["baseline"])
    if data.k != plan["k"]:
        dev_ids.append(deviate("k_mismatch", cell["id"], {"planned": plan["k"], "actual": data.k}))
    t = plan["test"]
    result = stats.paired_test(data, alpha=t["alpha"], m=t["m"], boot=t["boot"],
                               boot_max=t["boot_max"], seed=t["boot_seed"])
    revisions = {arm: meta.get("config", {}).get("model_revision") for arm, (_d, meta) in runs.items()}
    planned_rev = plan.get("model_revisions", {}).get(cell["model"])
    if len(set(revisions.values())) > 1 or (planned_rev and revisions["treatment"] != planned_rev):
        dev_ids.append(deviate("model_revision", cell["id"], {"planned": planned_rev,
                                                              "actual": revisions}))
    return {
        "kind": "cell", "cell_id": cell["id"], "cell": cell, "plan_hash": h,
        "code_version": code_version, "model_revision": revisions["treatment"],
        "model_revisions": revisions,
        "runs": {arm: {"path": _portable(run_dir, out_dir), "run_id": meta.get("run_id"),
                       "config_hash": meta.get("config_hash"),
                       "records_sha256": sha256_file(Path(run_dir) / "records.jsonl")}
                 for arm, (run_dir, meta) in runs.items()},
        "result": result.to_dict(), "deviations": dev_ids, "finished_at": _now(),
    }
