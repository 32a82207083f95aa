"""Confirmation: run a registered plan's cells on the confirm split, once per cell.

`confirm` runs exactly the plan's cells through an injected runner (contract in `protocol.prereg`)
and records each finished cell in three HMAC-keyed, write-ahead hash chains: the registry's (the
commit point, keyed by plan hash), one beside the plan and one in the confirm directory
(`ledger.jsonl`, which `report` reads); irregularities go to `deviations.jsonl`. Every attempt on a
cell is also written to the registry's cell file (`protocol.ledger.Registry.record_attempt`):
"started" before the cell's first generation, "confirmed" after its commit, so an abandoned
confirmation stays visible and another plan with the same cell identity is refused.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Iterable
from pathlib import Path

from protocol import report, stats
from protocol.errors import ProtocolError
from protocol.io import canonical_json, dumps, ensure_dir, exclusive_lock, load_json_object, sha256_file, write_atomic
from protocol.ledger import (STATE_ENV, HashChain, Registry, deviations_path, ledger_path, plan_ledger_path,
                             plan_of_chain)
from protocol.plans import (ARMS, CONFIG_SCHEMA_VERSION, DEFAULT_RUNNER_SPEC, arm_config, cell_identity, cell_key,
                            check_repeats, load_plan, superseded_plans)
from protocol.splits import manifest_sha256

Runner = Callable[[dict, str, dict, Path], Path]
# What a confirmation confirms: an override may not change it (the statistics and dataset included).
_FIXED = {"split", "plan_hash", "model", "budget", "stats_sha256", "dataset"}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _current_manifest_hash(dataset: str = "math500") -> str:
    return manifest_sha256(splits_dir=None, dataset=dataset)


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


def _planned_as_recorded(cfg: dict) -> dict:
    """The planned arm configuration in the form a run records it: a run names its calibration
    statistics by content (`scorer_params.stats = "sha256:<hex>"`), so a planned statistics path is
    compared through the cell's registered `stats_sha256` (the file at the path is not the identity)."""
    stats = (cfg.get("scorer_params") or {}).get("stats")
    if isinstance(stats, str) and not stats.startswith("sha256:") and cfg.get("stats_sha256"):
        return dict(cfg, scorer_params=dict(cfg["scorer_params"], stats=f"sha256:{cfg['stats_sha256']}"))
    return cfg


def _read_run_config(run_dir: Path) -> dict:
    try:
        return load_json_object(Path(run_dir) / "config.json", "run configuration")
    except ProtocolError as exc:
        raise ProtocolError(f"runner returned {run_dir} without a readable config.json ({exc})") from None


def check_overrides(overrides: dict | None, reason: str | None) -> None:
    """Overrides need a reason and may not change what is being confirmed."""
    if overrides and not reason:
        raise ProtocolError("overriding the registered configuration needs a reason (deviation log)")
    bad = sorted(k for k in overrides or {} if k.split(".")[0] in _FIXED)
    if bad:
        raise ProtocolError(f"cannot override {bad}: they define what is being confirmed")


def runner_record(plan: dict, runner_spec: str | None) -> dict:
    """{"spec", "registered"}: the runner a confirmation used and whether the plan registered it
    (the built-in runner counts as registered when the plan names none). runner_spec None: the
    caller runs the plan's own runner."""
    planned = plan.get("runner", DEFAULT_RUNNER_SPEC)
    spec = runner_spec or planned
    return {"spec": spec, "registered": spec == planned}


def confirm(plan_path: Path, out_dir: Path, runner: Runner, *, manifest_hash: str | None = None,
            code_version: str | None = None, config_schema: int = CONFIG_SCHEMA_VERSION,
            cells: Iterable[str] | None = None, overrides: dict | None = None, reason: str | None = None,
            grade=None, validate: Callable[[dict], None] | None = None, registry: Registry | None = None,
            log: Callable[[str], None] | None = None, runner_spec: str | None = None,
            deviations: Iterable[tuple[str, dict]] = ()) -> list[dict]:
    """Run the plan's cells on the confirm split and record each finished cell, once per cell.

    plan_path: a registered plan file; out_dir: the confirmation directory (ledger.jsonl,
    deviations.jsonl, runs/<cell>/...). runner: see `protocol.prereg`. manifest_hash: the current
    split manifest hash (default: read through protocol.splits). cells: ids to run (default: every
    cell not yet confirmed); naming an already confirmed cell is refused, whichever directory
    confirmed it, and so is a cell another plan confirmed or started unless this plan supersedes
    it. overrides: {dotted key: value} changes to the registered configuration, allowed only with a
    `reason` and logged as deviations. grade: passed to the record loader for records without a
    verdict. validate: called with every arm configuration before anything is written; what it
    raises is an input error, never a crash deviation (so is a `ProtocolError` raised by the
    runner). registry: the user-level registry (default: `protocol.ledger.Registry()`).
    runner_spec: MODULE:FUNCTION of `runner`, recorded in the ledger; one the plan did not register
    is a "runner" deviation of each cell (None: the plan's registered runner). deviations: (kind,
    detail) pairs the caller logs for each cell (e.g. a source tree with uncommitted changes). A refused
    confirmation leaves no folder behind that it created. Returns the entries written.
    """
    say = log or (lambda _msg: None)
    if runner is None:
        raise ProtocolError("no generation runner is installed for confirm")
    plan_path = Path(plan_path)
    plan, h = load_plan(plan_path)
    current_manifest = manifest_hash or _current_manifest_hash(plan.get("dataset", "math500"))
    if current_manifest != plan["split_manifest_sha256"]:
        raise ProtocolError(f"split manifest {current_manifest[:12]} differs from the registered "
                            f"{plan['split_manifest_sha256'][:12]}: refusing to confirm")
    for schema in (int(config_schema), plan["config_schema"]):
        if schema > CONFIG_SCHEMA_VERSION:
            raise ProtocolError(f"configuration schema {schema} is unknown to this code (it writes "
                                f"schema {CONFIG_SCHEMA_VERSION}): refusing to confirm")
    if int(config_schema) != plan["config_schema"]:
        raise ProtocolError(f"configuration schema {config_schema} differs from the registered "
                            f"{plan['config_schema']}: refusing to confirm")
    check_overrides(overrides, reason)
    code_version = code_version or "unknown"
    registry = registry or Registry()
    by_id = {c["id"]: c for c in plan["cells"]}
    wanted = None
    if cells is not None:
        wanted = list(dict.fromkeys(cells))
        unknown = [c for c in wanted if c not in by_id]
        if unknown:
            raise ProtocolError(f"cell(s) {unknown} are not in plan {h[:12]}")
    # Input errors surface here, before anything is written.
    configs = {(c, arm): arm_config(plan, h, by_id[c], arm, overrides) for c in wanted or by_id for arm in ARMS}
    if validate is not None:
        for cfg in configs.values():
            validate(cfg)
    used_runner = runner_record(plan, runner_spec)

    out_dir = Path(out_dir)
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    ensure_dir(out_dir, "confirm directory")
    try:
        with registry.lock(h), exclusive_lock(out_dir / ".confirm.lock", "confirm"):
            return _confirm_cells(plan, h, plan_path, out_dir, runner, wanted, by_id, configs, overrides,
                                  reason, code_version, grade, registry, used_runner, say, list(deviations))
    except ProtocolError:
        _remove_if_untouched(out_dir, created)
        raise


def _remove_if_untouched(out_dir: Path, created: list[Path]) -> None:
    """Remove the folders a refused confirmation created, when they hold nothing but its lock."""
    lock = out_dir / ".confirm.lock"
    if out_dir in created and lock.exists() and [p.name for p in out_dir.iterdir()] == [lock.name]:
        lock.unlink()
    for folder in created:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (something was written) or already gone


def _confirm_cells(plan, h, plan_path, out_dir, runner, wanted, by_id, configs, overrides, reason,
                   code_version, grade, registry, used_runner, say, extra_deviations=()) -> list[dict]:
    books = _Books.open(registry, h, plan, plan_path, out_dir)
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
    repeats = check_repeats(plan, h, registry, wanted)  # another plan on the same cell identity
    deviations = books.devlog.entries()

    def deviate(kind: str, cell: str | None, detail: dict) -> str:
        entry = books.devlog.append({"kind": kind, "cell_id": cell, "plan_hash": h,
                                     "code_version": code_version, "at": _now(), **detail})
        say(f"deviation ({kind}) {cell or ''}: {dumps(detail, sort_keys=True)}")
        return entry["hash"]

    sup_reason = (plan.get("supersedes") or {}).get("reason")
    registration = registry.registration(h)
    late = registration is not None and registration.get("by") == "confirm"
    claimed = load_json_object(plan_path, "plan file").get("registered_at") if late else None
    written = []
    for cid in wanted:
        cell = by_id[cid]
        key, superseded = repeats[cid]
        # Recorded before the first generation: an abandoned confirmation stays visible.
        registry.record_attempt(key, plan_hash=h, cell_id=cid, status="started", out_dir=books.out_id,
                                supersedes=superseded, reason=sup_reason if superseded else None)
        dev_ids = []
        if code_version != plan["code_version"]:
            dev_ids.append(deviate("code_version", cid, {"planned": plan["code_version"],
                                                         "actual": code_version}))
        if late:  # the plan file's registered_at is a claim: the registry first saw it at confirm
            dev_ids.append(deviate("registered_at_confirm", cid, {"planned": claimed,
                                                                  "actual": registration.get("at")}))
        for kind, detail in extra_deviations:
            dev_ids.append(deviate(kind, cid, detail))
        if not used_runner["registered"]:
            dev_ids.append(deviate("runner", cid, {"planned": plan.get("runner", DEFAULT_RUNNER_SPEC),
                                                   "actual": used_runner["spec"]}))
        if any(d.get("kind") == "crash" and d.get("cell_id") == cid for d in deviations):
            dev_ids.append(deviate("rerun_after_crash", cid, {}))
        for okey, value in (overrides or {}).items():
            dev_ids.append(deviate("override", cid, {"field": okey, "value": value, "reason": reason}))
        runs = {}
        for arm in ARMS:
            cfg = configs[(cid, arm)]
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
            for mm in _mismatches(_planned_as_recorded(cfg), actual):
                dev_ids.append(deviate("config_mismatch", cid, {"arm": arm, **mm}))
            runs[arm] = (run_dir, meta)
        entry = _finish_cell(plan, h, cell, runs, out_dir, code_version, grade, deviate, dev_ids)
        entry.update({"cell_identity": cell_identity(plan, cell), "cell_key": key, "test": plan["test"],
                      "runner": used_runner})
        if superseded:
            entry["supersedes"] = {"plans": superseded, "reason": sup_reason}
        entry = books.commit(entry)
        registry.record_attempt(key, plan_hash=h, cell_id=cid, status="confirmed", out_dir=books.out_id,
                                supersedes=superseded, reason=sup_reason if superseded else None)
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
    the plan, the confirm directory's copy, the run sidecars and the cell's "confirmed" attempt
    follow, and `sync` re-creates whatever a kill left out, from any verified copy.
    """

    def __init__(self, h: str, key: bytes, plan: dict, plan_path: Path, out_dir: Path, registry: Registry):
        self.h, self.plan, self.out_dir, self.out_id = h, plan, out_dir, str(out_dir.resolve())
        self.cells = registry
        self.registry = HashChain(registry.plan_dir(h) / "ledger.jsonl", key)
        self.beside = HashChain(plan_ledger_path(plan_path), key)
        self.local = HashChain(ledger_path(out_dir), key)
        self.devlog = HashChain(deviations_path(out_dir), key)

    @classmethod
    def open(cls, registry: Registry, h: str, plan: dict, plan_path: Path, out_dir: Path) -> "_Books":
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
            # a plan written before registries existed, copied here, or edited and re-hashed by
            # hand: registered now, which each cell's deviation log records
            key = registry.register(h, by="confirm")
        return cls(h, key, plan, plan_path, out_dir, registry)

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
        self._attempt(content)

    def _attempt(self, content: dict) -> None:
        """The cell's "confirmed" attempt in the registry (a no-op when it is there)."""
        cell = next((c for c in self.plan["cells"] if c["id"] == content["cell_id"]), content.get("cell"))
        key = content.get("cell_key") or cell_key(cell_identity(self.plan, cell))
        superseded = superseded_plans(self.plan, self.cells.cell_attempts(key))
        self.cells.record_attempt(key, plan_hash=self.h, cell_id=content["cell_id"], status="confirmed",
                                  out_dir=content.get("out_dir") or self.out_id, supersedes=superseded,
                                  reason=(self.plan.get("supersedes") or {}).get("reason") if superseded else None)

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
