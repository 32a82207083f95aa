"""Pre-registration, confirmation and the append-only ledger (protocol section 5).

A *plan* fixes, before any confirm-split result exists, the cells (model x budget), the treatment
and baseline configurations, k, the seed, the max-token limit, the test (B, alpha, m), the split
manifest hash, the configuration schema version and the code version. The plan file is

    {"plan_hash": sha256(canonical_json(plan)), "registered_at": ..., "plan": {...}}

and is named `plan-<hash[:12]>.json` when written into a directory, so the hash names it.

`confirm` runs exactly the plan's cells on the `confirm` split through an injected runner and
appends each finished cell to `ledger.jsonl`; irregularities go to `deviations.jsonl`. Both logs are
hash chains: line i stores `prev` (line i-1's hash) and `hash = sha256(prev + canonical content)`,
so an edited, removed or reordered line breaks the chain; a `<log>.head` checkpoint (count and last
hash, replaced atomically) also catches a truncated tail.

The runner contract (the real generation runner is plugged in by the CLI layer):

    runner(cell: dict, arm: str, arm_config: dict, out_dir: Path) -> Path

* `cell` = {"id", "model", "budget"}; `arm` is "baseline" or "treatment";
* `arm_config` is the complete run configuration to use (the plan's arm configuration plus model,
  budget, samples=k, seed, max_new_tokens, split="confirm", plan_hash, and any declared overrides);
* `out_dir` is where to create the run directory (`<confirm out>/runs/<cell id>/`);
* it returns a run directory holding `config.json` and `records.jsonl` (docs/records.md) and raises
  on failure (the crash is logged as a deviation and the cell can be rerun).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from protocol.errors import ProtocolError
from protocol.io import canonical_json, dumps, load_json, load_json_object, sha256_file, sha256_text, write_atomic

PLAN_SCHEMA = "retention.plan/1"
# Version of the run-configuration schema a plan was registered against. The runtime may pass its
# own value to `confirm`; a mismatch means the registered configuration no longer means the same.
CONFIG_SCHEMA_VERSION = 1
GENESIS = "0" * 64
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


def write_plan(plan: dict, out: Path) -> tuple[Path, str, bool]:
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
        return path, h, False
    path.parent.mkdir(parents=True, exist_ok=True)
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
# Hash-chained append-only logs


def _entry_hash(prev: str, content: dict) -> str:
    return sha256_text(prev + canonical_json(content))


class HashChain:
    """An append-only JSONL log whose lines are chained by sha256.

    Each line is `{..content.., "prev": <previous hash>, "hash": sha256(prev + canonical(content
    with prev))}`; `<name>.head` holds {"count", "hash"} of the last checkpoint.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.head_path = self.path.with_name(self.path.name + ".head")

    def entries(self) -> list[dict]:
        """All entries after verifying the chain; ProtocolError on any break."""
        if not self.path.exists():
            if self.head_path.exists():
                raise ProtocolError(f"{self.path} is missing but its head checkpoint exists")
            return []
        prev, out = GENESIS, []
        with open(self.path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                try:
                    entry = json.loads(line)
                except ValueError:
                    raise ProtocolError(f"{self.path}:{lineno}: unreadable line (corrupt log)") from None
                content = {k: v for k, v in entry.items() if k != "hash"}
                if entry.get("prev") != prev:
                    raise ProtocolError(f"{self.path}:{lineno}: chain broken (a line was removed, "
                                        "reordered or inserted)")
                if entry.get("hash") != _entry_hash(prev, content):
                    raise ProtocolError(f"{self.path}:{lineno}: hash mismatch (line was edited)")
                prev = entry["hash"]
                out.append(entry)
        self._check_head(out)
        return out

    def _check_head(self, entries: list[dict]) -> None:
        if not self.head_path.exists():
            if entries:
                raise ProtocolError(f"{self.head_path} is missing (log tampered)")
            return
        head = json.loads(self.head_path.read_text(encoding="utf-8"))
        count = int(head.get("count", -1))
        # A crash between appending and updating the head leaves the log longer than the head.
        if count > len(entries) or (count > 0 and entries[count - 1]["hash"] != head.get("hash")):
            raise ProtocolError(f"{self.path}: does not extend its head checkpoint "
                                "(lines were removed or rewritten)")

    def append(self, content: dict) -> dict:
        """Verify, then append one entry (flushed and fsynced) and move the head checkpoint."""
        existing = self.entries()
        prev = existing[-1]["hash"] if existing else GENESIS
        body = {k: v for k, v in content.items() if k not in ("prev", "hash")}
        body["prev"] = prev
        entry = {**body, "hash": _entry_hash(prev, body)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(canonical_json(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        write_atomic(self.head_path, canonical_json({"count": len(existing) + 1,
                                                     "hash": entry["hash"]}) + "\n")
        return entry


def ledger_path(out_dir: Path) -> Path:
    return Path(out_dir) / "ledger.jsonl"


def deviations_path(out_dir: Path) -> Path:
    return Path(out_dir) / "deviations.jsonl"


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


@contextlib.contextmanager
def _exclusive(out_dir: Path):
    import fcntl

    fh = open(Path(out_dir) / ".confirm.lock", "w")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ProtocolError(f"another confirm is running in {out_dir}") from None
        yield
    finally:
        fh.close()


def _read_run_config(run_dir: Path) -> dict:
    try:
        return load_json_object(Path(run_dir) / "config.json", "run configuration")
    except ProtocolError as exc:
        raise ProtocolError(f"runner returned {run_dir} without a readable config.json ({exc})") from None


def confirm(plan_path: Path, out_dir: Path, runner: Runner | None = None, *,
            manifest_hash: str | None = None, code_version: str | None = None,
            config_schema: int = CONFIG_SCHEMA_VERSION, cells: Iterable[str] | None = None,
            overrides: dict | None = None, reason: str | None = None, grade=None,
            log: Callable[[str], None] | None = None) -> list[dict]:
    """Run the plan's cells on the confirm split and append each finished cell to the ledger.

    plan_path: a registered plan file; out_dir: the confirmation directory (ledger.jsonl,
    deviations.jsonl, runs/<cell>/...). runner: see the module docstring (defaults to
    DEFAULT_RUNNER). manifest_hash: the current split manifest hash (default: read through
    protocol.splits). cells: ids to run (default: every cell not yet confirmed); naming an already
    confirmed cell is refused. overrides: {dotted key: value} changes to the registered
    configuration, allowed only with a `reason` and logged as deviations. grade: passed to the
    record loader for records without a verdict. Returns the ledger entries written.
    """
    say = log or (lambda _msg: None)
    runner = runner or DEFAULT_RUNNER
    if runner is None:
        raise ProtocolError("no generation runner is installed for confirm")
    plan, h = load_plan(Path(plan_path))
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

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(out_dir):
        ledger, devlog = HashChain(ledger_path(out_dir)), HashChain(deviations_path(out_dir))
        entries, deviations = ledger.entries(), devlog.entries()
        foreign = {e.get("plan_hash") for e in entries} - {h}
        if foreign:
            raise ProtocolError(f"{ledger.path} belongs to another plan ({sorted(foreign)[0][:12]}); "
                                "use a separate confirm directory per plan")
        done = {e["cell_id"] for e in entries if e.get("kind") == "cell"}
        by_id = {c["id"]: c for c in plan["cells"]}
        if cells is not None:
            wanted = list(dict.fromkeys(cells))
            unknown = [c for c in wanted if c not in by_id]
            if unknown:
                raise ProtocolError(f"cell(s) {unknown} are not in plan {h[:12]}")
            again = [c for c in wanted if c in done]
            if again:
                raise ProtocolError(f"cell(s) {again} already confirmed in {ledger.path}; "
                                    "a second confirmation is refused")
        else:
            wanted = [c for c in by_id if c not in done]
            if not wanted:
                raise ProtocolError(f"all {len(by_id)} cells of plan {h[:12]} are already confirmed")
            if done:
                say(f"already confirmed, not rerun: {', '.join(sorted(done))}")

        # Sidecars are written only after the ledger entry: one without its entry means the
        # ledger lost lines (or was deleted), and a second confirmation must not slip through.
        orphans = [c for c in wanted if any((out_dir / "runs" / c).rglob("confirm.json"))]
        if orphans:
            raise ProtocolError(f"cell(s) {orphans} carry confirm.json sidecars but are missing "
                                f"from {ledger.path}: the ledger was truncated or replaced")

        def deviate(kind: str, cell: str | None, detail: dict) -> str:
            entry = devlog.append({"kind": kind, "cell_id": cell, "plan_hash": h,
                                   "code_version": code_version, "at": _now(), **detail})
            say(f"deviation ({kind}) {cell or ''}: {json.dumps(detail, sort_keys=True)}")
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
                except Exception as exc:  # noqa: BLE001 - any runner failure is a logged deviation
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
            entry = ledger.append(entry)
            for arm, (run_dir, meta) in runs.items():
                sidecar = {"plan_hash": h, "cell_id": cid, "arm": arm, "code_version": code_version,
                           "model_revision": meta.get("config", {}).get("model_revision"),
                           "ledger_entry": entry["hash"],
                           "records_sha256": entry["runs"][arm]["records_sha256"]}
                write_atomic(Path(run_dir) / "confirm.json", dumps(sidecar, indent=2) + "\n")
            say(f"{cid}: confirmed, d = {100 * entry['result']['estimate']:+.2f} pp, "
                f"p = {entry['result']['p_bootstrap']:.4g} ({entry['result']['verdict']})")
            written.append(entry)
        return written


def _portable(run_dir: Path, base: Path) -> str:
    """A run path relative to the confirm directory when inside it, so the tree can be moved."""
    path = Path(run_dir).resolve()
    try:
        return str(path.relative_to(Path(base).resolve()))
    except ValueError:
        return str(path)


def _finish_cell(plan, h, cell, runs, out_dir, code_version, grade, deviate, dev_ids) -> dict:
    """Pair the two arms, run the registered test and build the ledger entry of one cell."""
    from protocol import report, stats

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


def read_confirmation(out_dir: Path) -> dict:
    """Verified ledger and deviation log of a confirm directory: {"plan_hash", "cells", "deviations"}."""
    entries = HashChain(ledger_path(out_dir)).entries()
    deviations = HashChain(deviations_path(out_dir)).entries()
    hashes = sorted({e.get("plan_hash") for e in entries + deviations} - {None})
    return {"plan_hash": hashes[0] if len(hashes) == 1 else hashes or None,
            "cells": [e for e in entries if e.get("kind") == "cell"], "deviations": deviations}
