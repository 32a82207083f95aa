"""Keyed, write-ahead hash chains: the append-only JSONL logs of the registry and the ledgers.

Each line is `{..content.., "prev", "hash"}`, chained with HMAC-SHA256 under a key, so a chain
recomputed with plain sha256 (or any other key) fails. Write-ahead: before a line is appended, the
head file is replaced (atomically) by `{"count", "hash", "pending": <the full entry>}`; after the
append it becomes `{"count", "hash"}`. A kill at any moment therefore leaves a state `entries()`
completes: the pending entry is written (or its newline finished) and the head moved on.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from protocol.errors import ProtocolError
from protocol.io import append_line, canonical_json, ensure_dir, jsonl_line, load_json_object, read_jsonl, write_atomic

GENESIS = "0" * 64


def entry_hash(key: bytes, prev: str, content: dict) -> str:
    """HMAC-SHA256 of `prev + canonical(content)` under the plan's key."""
    return hmac.new(key, (prev + canonical_json(content)).encode("utf-8"), hashlib.sha256).hexdigest()


class HashChain:
    """An append-only JSONL log, each line `{..content.., "prev", "hash"}` chained by HMAC.

    `<name>.head` is the write-ahead checkpoint (module docstring). `entries()` verifies every line
    (an edited, removed, reordered or inserted line, a recomputed chain, a truncated tail are all
    refused) and completes an interrupted append.
    """

    def __init__(self, path: Path, key: bytes):
        self.path = Path(path)
        self.head_path = self.path.with_name(self.path.name + ".head")
        self.key = key

    def _hash(self, prev: str, content: dict) -> str:
        return entry_hash(self.key, prev, content)

    def _read_head(self) -> dict | None:
        if not self.head_path.exists():
            return None
        head = load_json_object(self.head_path, "ledger head")
        if not isinstance(head.get("count"), int) or not isinstance(head.get("hash"), str):
            raise ProtocolError(f"{self.head_path}: not a head checkpoint")
        return head

    def _verify(self, rows) -> list[dict]:
        prev, out = GENESIS, []
        for lineno, entry in rows:
            content = {k: v for k, v in entry.items() if k != "hash"}
            if entry.get("prev") != prev:
                raise ProtocolError(f"{self.path}:{lineno}: chain broken (a line was removed, "
                                    "reordered or inserted)")
            if entry.get("hash") != self._hash(prev, content):
                raise ProtocolError(f"{self.path}:{lineno}: hash mismatch (line was edited, or the "
                                    "chain recomputed without the plan's key)")
            prev = entry["hash"]
            out.append(entry)
        return out

    def entries(self) -> list[dict]:
        """All entries after verifying the chain (and completing an interrupted append)."""
        head = self._read_head()
        if not self.path.exists():
            if head is None:
                return []
            if head["count"] == 0 and "pending" in head:  # killed before the first line
                return self._complete(head, [], 0)
            raise ProtocolError(f"{self.path} is missing but its head checkpoint exists")
        read = read_jsonl(self.path, "ledger")
        entries = self._verify(read.rows)
        if head is None:
            if entries or read.partial_tail:
                raise ProtocolError(f"{self.head_path} is missing (log tampered)")
            return entries
        count, pending = head["count"], head.get("pending")
        if pending is not None:
            if len(entries) == count + 1 and entries[-1] == pending and not read.partial_tail:
                self._write_head(count + 1, pending["hash"])
                return entries
            if len(entries) == count:
                return self._complete(head, entries, read.valid_end)
            raise ProtocolError(f"{self.path}: does not match its write-ahead head")
        if read.partial_tail:
            raise ProtocolError(f"{self.path}: unreadable last line with no pending write (corrupt log)")
        if count != len(entries) or (count and entries[-1]["hash"] != head["hash"]):
            raise ProtocolError(f"{self.path}: does not match its head checkpoint "
                                "(lines were removed, added or rewritten)")
        return entries

    def _complete(self, head: dict, entries: list[dict], valid_end: int) -> list[dict]:
        """Finish the append the head announced: drop a half line, write the entry, move the head."""
        pending = head["pending"]
        prev = entries[-1]["hash"] if entries else GENESIS
        body = {k: v for k, v in pending.items() if k != "hash"}
        if body.get("prev") != prev or pending.get("hash") != self._hash(prev, body):
            raise ProtocolError(f"{self.head_path}: pending entry does not extend {self.path}")
        if self.path.exists():
            with open(self.path, "r+b") as fh:
                fh.truncate(valid_end)
        append_line(self.path, jsonl_line(pending))
        self._write_head(len(entries) + 1, pending["hash"])
        return entries + [pending]

    def _write_head(self, count: int, last: str, pending: dict | None = None) -> None:
        head = {"count": count, "hash": last, **({"pending": pending} if pending else {})}
        write_atomic(self.head_path, canonical_json(head) + "\n")

    def append(self, content: dict) -> dict:
        """Verify, then append one entry write-ahead; returns the entry with `prev` and `hash`."""
        existing = self.entries()
        prev = existing[-1]["hash"] if existing else GENESIS
        body = {k: v for k, v in content.items() if k not in ("prev", "hash")}
        body["prev"] = prev
        entry = {**body, "hash": self._hash(prev, body)}
        ensure_dir(self.path.parent, "ledger folder")
        self._write_head(len(existing), prev, pending=entry)
        append_line(self.path, jsonl_line(entry))
        self._write_head(len(existing) + 1, entry["hash"])
        return entry
