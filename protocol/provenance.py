"""What a report knows about pre-registration: ledgers, registered tests, attempts, deviations.

For every confirm-split run the report checks the verified ledger of its confirm directory and the
user-level registry (`protocol.ledger`). Per confirmed cell it gathers

* the registered test (the ledger entry's `test`, the plan's test verbatim; entries written before
  it existed fall back to the fields of their `result`), which the report then applies;
* the runner that produced it (`runner: {"spec", "registered"}`): an unregistered runner is a
  deviation, synthesized here when the deviation log lacks it;
* every attempt at the same cell identity in the registry (`Registry.cell_attempts(cell_key)`,
  when the registry provides it): more than one confirmation, or one started and never finished,
  is shown beside the cell.
"""

from __future__ import annotations

from pathlib import Path

from protocol.errors import ProtocolError
from protocol.io import sha256_file
from protocol.ledger import Registry, confirmed_in, read_confirmation
from protocol.runs import Run

# Command-line spelling of each test setting (for the refusal line).
FLAGS = {"alpha": "--alpha", "boot": "--boot", "boot_max": "--boot-max", "seed": "--boot-seed", "m": "--m"}


def _find_confirm_dirs(runs: list[Run], explicit) -> list[Path]:
    dirs = []
    for d in map(Path, explicit or []):
        if not d.is_dir():
            raise ProtocolError(f"--confirm-dir {d}: no such confirm directory")
        if not ((d / "ledger.jsonl").is_file() or (d / "deviations.jsonl").is_file()):
            raise ProtocolError(f"--confirm-dir {d}: not a confirm directory (no ledger.jsonl or "
                                "deviations.jsonl)")
        dirs.append(d)
    for run in runs:
        if run.plan_hash is None:
            continue
        for parent in list(run.path.resolve().parents)[:4]:
            if (parent / "ledger.jsonl").is_file() or (parent / "deviations.jsonl").is_file():
                dirs.append(parent)
                break
    return list(dict.fromkeys(d.resolve() for d in dirs))


def is_confirm_run(run: Run) -> bool:
    """A run on the confirm split (or made for a plan): its numbers count only if confirmed."""
    return run.config.get("split") == "confirm" or run.plan_hash is not None


def confirmation_status(run: Run, registry: Registry) -> str | None:
    """None when the run is an arm of a cell confirmed in the registry with exactly these records;
    else why not (printed as UNCONFIRMED)."""
    h = run.plan_hash
    if h is None:
        return "confirm-split run without a plan hash"
    if registry.key(h) is None:
        return f"plan {h[:12]} is not in the registry {registry.root}: cannot verify"
    if not (run.path / "records.jsonl").is_file():
        return "sharded run not merged: no records.jsonl to verify"
    records = sha256_file(run.path / "records.jsonl")
    config_hash = run.meta.get("config_hash")
    changed = False
    for entry in registry.ledger(h).entries():
        for info in (entry.get("runs") or {}).values():
            if info.get("config_hash") == config_hash and info.get("run_id") == run.meta.get("run_id"):
                if info.get("records_sha256") == records:
                    return None
                changed = True
    if changed:
        return "records changed since confirmation"
    return f"no ledger entry of plan {h[:12]} for this run"


def registered_test(entry: dict) -> dict | None:
    """The test a ledger entry registered: `entry["test"]`, else what its result records."""
    test = entry.get("test")
    if isinstance(test, dict):
        return {"name": test.get("name"), "boot": test.get("boot"), "boot_max": test.get("boot_max"),
                "seed": test.get("boot_seed"), "alpha": test.get("alpha"), "m": test.get("m")}
    res = entry.get("result")
    if not isinstance(res, dict):
        return None
    # The escalated B, or B itself: replaying the same data and seed makes the same decision.
    return {"name": "cluster-bootstrap", "boot": res.get("boot_requested", res.get("boot")),
            "boot_max": res.get("boot"), "seed": res.get("seed"), "alpha": res.get("alpha"),
            "m": res.get("m")}


def _attempts(registry, cell_key) -> list[dict]:
    lookup = getattr(registry, "cell_attempts", None)  # provided by registries that track cell identity
    if lookup is None or not cell_key:
        return []
    return [dict(a) for a in lookup(cell_key) or []]


def _attempts_into(out: dict, registry, entry: dict) -> str | None:
    """Record the attempts on a confirmed cell's identity; why the cell is not confirmed when the
    registry's cell record is damaged or holds no confirmation of this plan (deleted, or a
    partial registry wipe), else None."""
    key = entry["cell_key"]
    try:
        attempts = out["cell_attempts"][key] = _attempts(registry, key)
    except ProtocolError as exc:
        out["cell_attempts"][key] = []
        return f"registry record of cell {entry['cell_id']} unreadable: {exc}"
    if getattr(registry, "cell_attempts", None) is None:
        return None  # a registry without cell records: nothing to check
    if not any(a.get("status") == "confirmed" and a.get("plan_hash") == entry["plan_hash"]
               and a.get("cell_id") == entry["cell_id"] for a in attempts):
        return (f"the registry's record of cell {entry['cell_id']} holds no confirmation of plan "
                f"{entry['plan_hash'][:12]} (record deleted or replaced; if a confirmation was "
                "interrupted, rerunning confirm finishes it)")
    return None


def provenance(runs: list[Run], confirm_dirs, registry: Registry | None = None) -> dict:
    """Plan hashes of the runs, verified ledgers and deviation logs of their confirm directories,
    registered tests, attempts per cell and, per confirm-split run, why it is not a confirmed
    result (`unconfirmed`: run id -> reason)."""
    registry = registry or Registry()
    out = {"plan_hashes": sorted({r.plan_hash for r in runs if r.plan_hash}), "confirm_dirs": [],
           "deviations": [], "ledger_cells": [], "warnings": [], "unconfirmed": {},
           "registered_tests": {}, "cell_attempts": {}}
    foreign: dict = {}  # run id -> why its confirm directory's ledger cannot be verified here
    for d in _find_confirm_dirs(runs, confirm_dirs):
        try:
            conf = read_confirmation(d, registry)
        except ProtocolError as exc:
            if confirmed_in(registry, d):  # this registry confirmed into d: the ledger was tampered
                raise
            # Its lines do not verify under this registry's key of the plan and this registry never
            # confirmed into d: confirmed in another registry; its runs are not confirmed here.
            why = f"the ledger of {d} does not verify against the registry {registry.root} ({exc})"
            out["warnings"].append(why)
            foreign.update({r.run_id: why for r in runs if d in r.path.resolve().parents})
            continue
        out["confirm_dirs"].append(str(d))
        out["deviations"] += conf["deviations"]
        for entry in conf["cells"]:
            test, runner = registered_test(entry), entry.get("runner")
            cell = {"cell_id": entry["cell_id"], "plan_hash": entry["plan_hash"],
                    "cell_key": entry.get("cell_key"), "code_version": entry.get("code_version"),
                    "model_revision": entry.get("model_revision"), "hash": entry["hash"],
                    "test": test, "runner": runner,
                    "runs": {arm: {"run_id": i.get("run_id"), "config_hash": i.get("config_hash")}
                             for arm, i in (entry.get("runs") or {}).items()}}
            out["ledger_cells"].append(cell)
            if test is not None:
                out["registered_tests"][entry["plan_hash"]] = test
            if entry.get("cell_key"):
                why = _attempts_into(out, registry, entry)
                if why is not None:
                    for info in (entry.get("runs") or {}).values():
                        out["unconfirmed"].setdefault(str(info.get("run_id")), why)
            if isinstance(runner, dict) and runner.get("registered") is False and not any(
                    dv.get("kind") == "runner" and dv.get("cell_id") == entry["cell_id"]
                    and dv.get("plan_hash") == entry["plan_hash"] for dv in out["deviations"]):
                out["deviations"].append({"kind": "runner", "cell_id": entry["cell_id"],
                                          "plan_hash": entry["plan_hash"], "spec": runner.get("spec"),
                                          "source": "ledger entry (not in the deviation log)"})
    ids = {r.run_id for r in runs}
    flagged = {k: v for k, v in {**out["unconfirmed"], **foreign}.items() if k in ids}  # from the ledgers
    out["unconfirmed"] = {}
    for run in runs:
        if is_confirm_run(run):
            why = "; ".join(w for w in (confirmation_status(run, registry), flagged.get(run.run_id)) if w)
            if why:
                out["unconfirmed"][run.run_id] = why
                out["warnings"].append(f"UNCONFIRMED {run.path}: {why}")
    return out


def ledger_cell_of(prov: dict, treatment: Run, baseline: Run) -> dict | None:
    """The verified ledger cell whose treatment and baseline runs are this pair's."""
    same = lambda info, run: (info.get("config_hash") == run.meta.get("config_hash")  # noqa: E731
                              and info.get("run_id") == run.meta.get("run_id"))
    for cell in prov["ledger_cells"]:
        if same(cell["runs"].get("treatment") or {}, treatment) and same(cell["runs"].get("baseline") or {}, baseline):
            return cell
    return None


def check_given(given: dict, test: dict, cell: dict) -> None:
    """Refuse a command-line test setting that differs from the one registered for a confirmed cell."""
    for key, value in given.items():
        if value is None or test.get(key) is None:
            continue
        same = float(value) == float(test[key]) if key == "alpha" else int(value) == int(test[key])
        if not same:
            raise ProtocolError(f"{FLAGS[key]} {value} differs from the registered {key} {test[key]} of plan "
                                f"{cell['plan_hash'][:12]} (cell {cell['cell_id']}): a confirmed cell is "
                                f"reported with its registered test; drop {FLAGS[key]}")


def cell_status(prov: dict, cell: dict) -> tuple[str, bool]:
    """(confirmation text, deviates) of a confirmed cell: its deviations, an unregistered runner
    (`deviates`: the verdict is not a plain confirmed one), repeated or unfinished attempts."""
    devs = [d for d in prov["deviations"]
            if d.get("cell_id") == cell["cell_id"] and d.get("plan_hash") == cell["plan_hash"]]
    runner = cell.get("runner") if isinstance(cell.get("runner"), dict) else {}
    bad_runner = runner.get("registered") is False or any(d.get("kind") == "runner" for d in devs)
    if bad_runner:
        text = f"DEVIATION: runner {runner.get('spec') or '?'} not registered in the plan"
    else:
        text = "confirmed"
    others = [d.get("kind") for d in devs if d.get("kind") != "runner"]
    if others:
        text += f"; {len(others)} deviation(s) ({', '.join(dict.fromkeys(map(str, others)))})"
    attempts = prov["cell_attempts"].get(cell.get("cell_key")) or []
    done = [a for a in attempts if a.get("status") == "confirmed"]
    finished = {(a.get("plan_hash"), a.get("cell_id")) for a in done}
    # an attempt is recorded as "started" before it generates and "confirmed" when it commits
    started = [a for a in attempts if a.get("status") == "started"
               and (a.get("plan_hash"), a.get("cell_id")) not in finished]
    if len(done) > 1:
        text += f"; REPEATED: confirmed {len(done)} times ({attempt_reasons(done)})"
    if started:
        text += f"; {len(started)} attempt(s) started, not finished ({attempt_reasons(started)})"
    return text, bad_runner


def attempt_reasons(attempts: list[dict]) -> str:
    return "; ".join(f"plan {str(a.get('plan_hash'))[:12]} at {a.get('at')}: "
                     + (f"reason {a['reason']!r}" if a.get("reason") else "no reason given")
                     for a in attempts)
