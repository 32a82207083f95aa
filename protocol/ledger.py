"""The user-level registry of plans and confirmations (its hash chains: `protocol.chain`).

One confirmation per (plan, cell), wherever `confirm` runs: the registry lives in a user-level
state directory (`$RETENTION_STATE_DIR`, else the platform's user state directory), keyed by plan
hash, so neither `--out`, the working directory nor the plan file's name or location matter. And
one confirmation per *cell identity* (`protocol.plans.cell_identity`: what is compared, not the
plan's seed, note or k) across plans: `<state>/cells/<cell key>.jsonl` lists every attempt on the
cell, `{"plan_hash", "cell_id", "status": "started" | "confirmed", "at", "out_dir", "supersedes",
"reason"}`, chained under the registry's cell key (`<state>/cells/key`). The set of cells is
covered too: `<state>/cells/index.jsonl`, a chain under the same key, lists every cell key, and
its first line is written before any cell file exists. A cell file deleted with its head (or an
index deleted while cell files remain) is refused as registry damage, never read as "no attempts";
a cell file the index lacks (a kill between the two appends) is added to it.

Each registered plan has a folder `<state>/plans/<plan hash>/` holding

* `key`: 32 random bytes (hex) created at registration; every ledger line of the plan is chained
  with HMAC-SHA256 under it, so a chain recomputed with plain sha256 (or any other key) fails;
* `ledger.jsonl` (+ `.head`): the authoritative record of the plan's confirmed cells;
* `.lock`: held by a running confirmation, so two confirmations of one plan cannot race.

Copies of the ledger are kept beside the plan (`<plan stem>.ledger.jsonl`) and in the confirm
directory (`ledger.jsonl`, read by `report`); a cell present in any verified copy is confirmed.

Write-ahead: before a line is appended, the head file is replaced (atomically) by
`{"count", "hash", "pending": <the full entry>}`; after the append it becomes `{"count", "hash"}`.
A kill at any moment therefore leaves a state `entries()` completes: the pending entry is written
(or its newline finished) and the head moved on. Nothing is ever left "unusable".
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import os
import re
import secrets
from pathlib import Path

import platformdirs

from protocol.chain import GENESIS, HashChain, entry_hash  # noqa: F401 - re-exported
from protocol.errors import ProtocolError
from protocol.io import canonical_json, ensure_dir, exclusive_lock, load_json_object, read_jsonl, write_atomic

STATE_ENV = "RETENTION_STATE_DIR"
INDEX_NAME = "index.jsonl"  # the registry's index of cells, in <state>/cells/


def state_dir() -> Path:
    """The user-level state directory (`$RETENTION_STATE_DIR` overrides the platform default)."""
    env = os.environ.get(STATE_ENV)
    if env:
        return Path(env)
    return Path(platformdirs.user_state_dir("retention", appauthor=False))


class Registry:
    """Plans and their confirmations in the user-level state directory, keyed by plan hash, and
    every attempt on a cell identity, keyed by cell key (`<state>/cells/<cell key>.jsonl`)."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else state_dir()

    def plan_dir(self, plan_h: str) -> Path:
        return self.root / "plans" / plan_h

    def key(self, plan_h: str) -> bytes | None:
        path = self.plan_dir(plan_h) / "key"
        if not path.exists():
            return None
        return _read_key(path)

    def register(self, plan_h: str, by: str = "preregister") -> bytes:
        """The plan's key, created (mode 0600) if the plan is not registered yet, with its
        registration record (`registration`): when, and by which command."""
        existing = self.key(plan_h)
        if existing is not None:
            return existing
        key = _create_key(ensure_dir(self.plan_dir(plan_h), "registry folder"), "register plan")
        path = self.plan_dir(plan_h) / "registered.json"
        if not path.exists():
            record = {"at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "by": by}
            record["mac"] = entry_hash(key, GENESIS, record)
            write_atomic(path, canonical_json(record) + "\n")
        return key

    def registration(self, plan_h: str) -> dict | None:
        """{"at", "by": "preregister" | "confirm"} of a registered plan (None for a plan registered
        before the record existed); an edited record is refused."""
        path = self.plan_dir(plan_h) / "registered.json"
        if not path.exists():
            return None
        record = load_json_object(path, "registration record")
        body = {k: v for k, v in record.items() if k != "mac"}
        if record.get("mac") != entry_hash(self.require_key(plan_h), GENESIS, body):
            raise ProtocolError(f"{path}: registration record edited (registry damaged)")
        return body

    def require_key(self, plan_h: str) -> bytes:
        key = self.key(plan_h)
        if key is None:
            raise ProtocolError(f"plan {plan_h[:12]} is not registered in {self.root} "
                                f"(set ${STATE_ENV} to the registry it was registered in)")
        return key

    def ledger(self, plan_h: str) -> HashChain:
        return HashChain(self.plan_dir(plan_h) / "ledger.jsonl", self.require_key(plan_h))

    def lock(self, plan_h: str):
        ensure_dir(self.plan_dir(plan_h), "registry folder")
        return exclusive_lock(self.plan_dir(plan_h) / ".lock", f"confirmation of plan {plan_h[:12]}")

    # ---- cells: every attempt on a cell identity, across plans

    def cell_path(self, cell_key: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", str(cell_key)):
            raise ProtocolError(f"not a cell key: {cell_key!r}")
        return self.root / "cells" / f"{cell_key}.jsonl"

    def _cell_chain(self, cell_key: str, create: bool) -> HashChain | None:
        path = self.cell_path(cell_key)
        key_path = path.parent / "key"
        if key_path.exists():
            key = _read_key(key_path)
        elif path.exists():
            raise ProtocolError(f"{path} exists but the registry's cell key {key_path} is missing "
                                "(registry damaged)")
        elif not create:
            return None
        else:
            key = _create_key(ensure_dir(path.parent, "registry folder"), "register cells")
        return HashChain(path, key)

    def _index(self, key: bytes) -> HashChain:
        return HashChain(self.root / "cells" / INDEX_NAME, key)

    def _listed(self, key: bytes, *, create: bool) -> set[str]:
        """The cell keys of the registry's cell index (verified). A missing index is damage when any
        cell file exists (the index is started before the first one); else, with `create`, it is
        started (`{"kind": "index"}`)."""
        index = self._index(key)
        with _blocking_lock(index.path.with_name(INDEX_NAME + ".lock")):
            if not (index.path.exists() or index.head_path.exists()):
                cells = [p.name for p in index.path.parent.glob("*.jsonl") if p.name != INDEX_NAME]
                if cells:
                    raise ProtocolError(f"{index.path} is missing but {len(cells)} cell record(s) exist "
                                        "(registry damaged: the index of cells was deleted)")
                if create:
                    index.append({"kind": "index"})
            return {e.get("cell_key") for e in index.entries() if e.get("kind") == "cell"}

    def _list_cell(self, key: bytes, cell_key: str) -> None:
        """Add a cell key to the index (a no-op when it is there)."""
        index = self._index(key)
        with _blocking_lock(index.path.with_name(INDEX_NAME + ".lock")):
            if not any(e.get("cell_key") == cell_key for e in index.entries()):
                index.append({"kind": "cell", "cell_key": cell_key})

    def _check_present(self, chain: HashChain, cell_key: str, listed: set[str]) -> None:
        if cell_key in listed and not (chain.path.exists() or chain.head_path.exists()):
            raise ProtocolError(f"{chain.path} is missing but the registry's index of cells lists it "
                                "(registry damaged: a cell record was deleted)")

    def cell_attempts(self, cell_key: str) -> list[dict]:
        """Every recorded attempt on the cell, oldest first (verified chain), each exactly
        {"plan_hash", "cell_id", "status": "started" | "confirmed", "at", "out_dir",
        "supersedes": [plan hashes] or None, "reason": str or None}. A deleted cell record (the
        index lists it) is refused (`ProtocolError`)."""
        chain = self._cell_chain(cell_key, create=False)
        if chain is None:
            return []
        listed = self._listed(chain.key, create=False)
        self._check_present(chain, cell_key, listed)
        # Under the writers' lock: reading completes an interrupted append, which must not race
        # with a writer finishing its own.
        with _blocking_lock(chain.path.with_name(chain.path.name + ".lock")):
            entries = chain.entries()
        if entries and cell_key not in listed:  # killed between the cell's first line and the index
            self._list_cell(chain.key, cell_key)
        return [{f: e.get(f) for f in ATTEMPT_FIELDS} for e in entries]

    def record_attempt(self, cell_key: str, *, plan_hash: str, cell_id: str, status: str,
                       out_dir: str, supersedes: list[str] | None = None,
                       reason: str | None = None) -> dict | None:
        """Append an attempt unless it is already there: "started" once per (plan, cell, out
        folder), "confirmed" once per (plan, cell). Returns the new attempt, or None.

        Shards of one confirmation write here at once, so the check and the append hold a
        (blocking, short) lock on the cell's file. A cell record the index lists but that is
        missing is refused: recreating it would forget the attempts it held."""
        if status not in ("started", "confirmed"):
            raise ProtocolError(f"unknown attempt status {status!r}")
        chain = self._cell_chain(cell_key, create=True)
        listed = self._listed(chain.key, create=True)  # the index exists before any cell file
        self._check_present(chain, cell_key, listed)
        with _blocking_lock(chain.path.with_name(chain.path.name + ".lock")):
            attempt = None
            entries = chain.entries()
            if not any((a.get("plan_hash"), a.get("cell_id"), a.get("status")) == (plan_hash, cell_id, status)
                       and (status == "confirmed" or a.get("out_dir") == out_dir) for a in entries):
                attempt = {"plan_hash": plan_hash, "cell_id": cell_id, "status": status,
                           "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                           "out_dir": out_dir, "supersedes": list(supersedes) if supersedes else None,
                           "reason": reason}
                chain.append(attempt)
        if cell_key not in listed:
            self._list_cell(chain.key, cell_key)
        return attempt


# Fields of one attempt on a cell (`Registry.cell_attempts`).
ATTEMPT_FIELDS = ("plan_hash", "cell_id", "status", "at", "out_dir", "supersedes", "reason")


def _read_key(path: Path) -> bytes:
    try:
        return bytes.fromhex(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        raise ProtocolError(f"{path}: unreadable key (registry damaged)") from None


def _create_key(folder: Path, what: str) -> bytes:
    """32 random bytes written to `folder/key` (mode 0600); two creators at once agree on the
    first key written (O_EXCL)."""
    path = folder / "key"
    key = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_key(path)
    except OSError as exc:
        raise ProtocolError(f"cannot {what} in {folder}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(key.hex() + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return key


@contextlib.contextmanager
def _blocking_lock(path: Path):
    """An exclusive `flock` held for a few file operations (waits for the other holder)."""
    try:
        fh = open(path, "a")
    except OSError as exc:
        raise ProtocolError(f"cannot lock {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()


def plan_ledger_path(plan_path: Path) -> Path:
    """The ledger kept beside a plan file: `plan-abc.json` -> `plan-abc.ledger.jsonl`."""
    plan_path = Path(plan_path)
    return plan_path.with_name(plan_path.stem + ".ledger.jsonl")


def ledger_path(out_dir: Path) -> Path:
    return Path(out_dir) / "ledger.jsonl"


def deviations_path(out_dir: Path) -> Path:
    return Path(out_dir) / "deviations.jsonl"


def plan_of_chain(path: Path) -> str | None:
    """The plan hash a ledger's lines name (read unverified, to find the key that verifies them)."""
    if not Path(path).exists():
        return None
    hashes = {e.get("plan_hash") for e in read_jsonl(path, "ledger").objects} - {None}
    if len(hashes) > 1:
        raise ProtocolError(f"{path}: lines of several plans ({', '.join(sorted(h[:12] for h in hashes))})")
    return hashes.pop() if hashes else None


def read_confirmation(out_dir: Path, registry: Registry | None = None) -> dict:
    """Verified ledger and deviation log of a confirm directory.

    Returns {"plan_hash", "cells", "deviations", "registered": {cell id: registry entry} or None}.
    `registered` is None when the plan's key is not in this registry (the lines cannot be verified);
    `report` then shows the runs as unconfirmed.
    """
    registry = registry or Registry()
    out_dir = Path(out_dir)
    h = plan_of_chain(ledger_path(out_dir)) or plan_of_chain(deviations_path(out_dir))
    key = registry.key(h) if h else None
    if h is None or key is None:
        return {"plan_hash": h, "cells": [], "deviations": [], "registered": None}
    cells = HashChain(ledger_path(out_dir), key).entries()
    deviations = HashChain(deviations_path(out_dir), key).entries()
    registered = {e["cell_id"]: e for e in registry.ledger(h).entries() if e.get("kind") == "cell"}
    return {"plan_hash": h, "cells": [e for e in cells if e.get("kind") == "cell"],
            "deviations": deviations, "registered": registered}


def confirmed_in(registry: Registry, out_dir: Path) -> bool:
    """Whether this registry committed a confirmation into `out_dir` (its ledger of the plan the
    directory's lines name holds an entry with that `out_dir`)."""
    out_dir = Path(out_dir)
    h = plan_of_chain(ledger_path(out_dir)) or plan_of_chain(deviations_path(out_dir))
    if h is None or registry.key(h) is None:
        return False
    return any(e.get("out_dir") == str(out_dir.resolve()) for e in registry.ledger(h).entries())
