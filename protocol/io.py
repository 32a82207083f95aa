"""The one I/O module: canonical JSON, strict JSON in and out, atomic writes, JSONL logs, locks.

Rules every file of the project follows (run directories, plans, ledgers, reports, graded records):

* JSON out is strict: `NaN`/`Infinity` are refused (`ProtocolError`), never written as bare tokens.
* Any string that JSON can carry round-trips: NUL is escaped by `json`, and a lone surrogate (legal
  in a JSON string, `"\\ud800"`, but not encodable as UTF-8) is written as its `\\uXXXX` escape, so
  the file stays valid UTF-8 and reads back to the same string.
* JSON in is strict too: invalid UTF-8, `NaN`/`Infinity` tokens and nesting too deep for the parser
  end in one `ProtocolError` naming the file (and line), never a traceback.
* `write_atomic` replaces a file in one rename: readers see the old or the new content, never half
  of it; the replaced file keeps its permission bits; errors name the user's path, not the
  temporary file.
* JSONL logs are appended one whole line per `write` call. A kill can leave only a half-written
  *last* line (no trailing newline); `read_jsonl` tolerates exactly that (reported, and `valid_end`
  says where the good bytes end) and refuses a corrupt earlier line with its line number.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from protocol.errors import ProtocolError

_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogates(text: str) -> str:
    # json.dumps(ensure_ascii=False) leaves lone surrogates as raw code points, which UTF-8 cannot
    # encode; outside strings JSON text holds none, so escaping every one is safe and reversible.
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def dumps(obj, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """Strict JSON text of `obj` (no NaN/inf; lone surrogates escaped; other text kept as is)."""
    try:
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=indent, sort_keys=sort_keys,
                          separators=None if indent is not None else (", ", ": "))
    except ValueError as exc:  # NaN/inf, circular reference
        raise ProtocolError(f"value is not plain JSON: {exc}") from None
    except TypeError as exc:
        raise ProtocolError(f"value is not plain JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("value is nested too deeply to write as JSON") from None
    return _escape_surrogates(text)


def canonical_json(obj) -> str:
    """Sorted keys, no whitespace, no NaN: the string that content hashes identify."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"cannot hash a value that is not plain JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError("cannot hash a value nested this deeply") from None
    return _escape_surrogates(text)


def config_hash(config: dict) -> str:
    """sha256 of a run configuration's canonical JSON: what `run` records and `report` checks."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError as exc:
        raise ProtocolError(f"cannot read {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def loads(text: str | bytes, *, where: str = "input"):
    """Strict JSON parse; any failure is one `ProtocolError` starting with `where`."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{where}: not UTF-8 (byte {exc.start}: {exc.reason})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno})") from None
    except ValueError as exc:  # NaN / Infinity tokens
        raise ProtocolError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ProtocolError(f"{where}: JSON nested too deeply") from None


def read_bytes(path: Path, what: str = "file") -> bytes:
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ProtocolError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ProtocolError(f"{path}: is a directory, expected a {what}") from None
    except OSError as exc:
        raise ProtocolError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_text(path: Path, what: str = "file") -> str:
    """The UTF-8 text of a file; missing, unreadable or non-UTF-8 files are one `ProtocolError`."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{path}: not UTF-8 (byte {exc.start}: {exc.reason})") from None


def load_json(path: Path, what: str = "JSON file"):
    """Parse one JSON file strictly (see `loads`)."""
    return loads(read_bytes(path, what), where=str(path))


def load_json_object(path: Path, what: str = "JSON file") -> dict:
    obj = load_json(path, what)
    if not isinstance(obj, dict):
        raise ProtocolError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _new_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` in one rename (temporary file in the same folder, fsync, rename).

    An existing file keeps its permission bits; a new one gets the umask's default (not mkstemp's
    0600). Any OS error is a `ProtocolError` naming `path`.
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = _new_file_mode()
    except OSError as exc:
        raise ProtocolError(f"cannot write {path}: {exc.strerror or exc}") from None
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise ProtocolError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_json(path: Path, obj, *, indent: int | None = 2, sort_keys: bool = True) -> None:
    """Atomically write strict JSON (a trailing newline included)."""
    write_atomic(path, dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def write_jsonl(path: Path, rows) -> None:
    """Atomically write one strict JSON object per line."""
    write_atomic(path, "".join(dumps(r) + "\n" for r in rows))


def jsonl_line(obj) -> bytes:
    """The bytes of one JSONL line (strict JSON, newline-terminated)."""
    return (dumps(obj) + "\n").encode("utf-8")


def append_line(path: Path, line: bytes, *, fsync: bool = True) -> int:
    """Append one whole line with a single `write` and return the file's new size.

    One write of an O_APPEND descriptor: a kill leaves the line whole or a prefix of it, never
    interleaved with another line.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _new_file_mode())
        try:
            view = memoryview(line)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if fsync:
                os.fsync(fd)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)
    except OSError as exc:
        raise ProtocolError(f"cannot write {path}: {exc.strerror or exc}") from None


@dataclass
class JsonlRead:
    """The result of `read_jsonl`.

    rows: (1-based line number, object) of every valid non-blank line;
    valid_end: byte offset where the valid content ends (a writer resuming truncates there);
    partial_tail: the file ended in a half-written line that was dropped.
    """

    rows: list[tuple[int, object]] = field(default_factory=list)
    valid_end: int = 0
    partial_tail: bool = False

    @property
    def objects(self) -> list:
        return [obj for _, obj in self.rows]


def read_jsonl(path: Path, what: str = "JSON", *, objects: bool = True,
               tolerate_partial_tail: bool = True) -> JsonlRead:
    """Read a JSONL file strictly.

    Only the last line may be damaged, and only when it has no trailing newline (a writer killed
    mid-line): it is dropped when `tolerate_partial_tail`, else refused. Any other unreadable line
    (not UTF-8, not JSON, not an object when `objects`) is a `ProtocolError` with its line number.
    A missing file is a `ProtocolError` too; check existence first where absence is normal.
    """
    data = read_bytes(path, f"{what} file")
    out = JsonlRead()
    pos, lineno = 0, 0
    while pos < len(data):
        lineno += 1
        nl = data.find(b"\n", pos)
        last = nl < 0
        end = len(data) if last else nl + 1
        raw = data[pos:end].rstrip(b"\r\n")
        try:
            if raw.strip():
                obj = loads(raw, where="")
                if objects and not isinstance(obj, dict):
                    raise ProtocolError(f": expected a JSON object, got {type(obj).__name__}")
                out.rows.append((lineno, obj))
        except ProtocolError as exc:
            if last and tolerate_partial_tail:
                out.partial_tail = True
                return out
            raise ProtocolError(f"{path}:{lineno}{exc} (unreadable {what} line)") from None
        if last and tolerate_partial_tail and raw.strip():
            # A complete object without its newline: the kill came between the two; keep it but
            # report the tail so writers re-terminate the line before appending.
            out.partial_tail = True
            out.valid_end = pos
            out.rows.pop()
            return out
        pos = end
        out.valid_end = end
    return out


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, what: str):
    """Hold an exclusive, non-blocking `flock` on `lock_path` for the duration of the block.

    A second holder gets one `ProtocolError` ("another ... is using ..."). The lock goes with the
    process, so a killed writer never leaves a stale lock behind.
    """
    lock_path = Path(lock_path)
    try:
        fh = open(lock_path, "a")
    except OSError as exc:
        raise ProtocolError(f"cannot lock {lock_path.parent}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ProtocolError(f"another {what} is using {lock_path.parent}; wait for it to finish") from None
        yield
    finally:
        fh.close()


def check_writable(path: Path, what: str = "output") -> Path:
    """Refuse, before any work, an output path that cannot be created: under a file, in a folder
    that cannot be written, or naming an existing folder. Creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise ProtocolError(f"{what} {path} is a folder, expected a file")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ProtocolError(f"{what} {path}: {parent} is a file, not a folder")
            try:  # a probe, removed at once: permissions alone do not tell (/proc, read-only mounts)
                os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=parent))
            except OSError as exc:
                raise ProtocolError(f"{what} {path}: cannot write in {parent} ({exc.strerror or exc})") from None
            return path
    return path


def check_writable_dir(path: Path, what: str = "output folder") -> Path:
    """Like `check_writable` for a folder to be created (or reused)."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ProtocolError(f"{what} {path} exists and is not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ProtocolError(f"{what} {path} is not writable")
        return path
    check_writable(path, what)
    return path


def ensure_dir(path: Path, what: str = "output folder") -> Path:
    """Create a folder (and parents) or fail with one line naming the user's path."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ProtocolError(f"{what} {path} exists and is not a folder") from None
    except NotADirectoryError:
        raise ProtocolError(f"{what} {path}: a parent is a file, not a folder") from None
    except OSError as exc:
        raise ProtocolError(f"cannot create {what} {path}: {exc.strerror or exc}") from None
    if not path.is_dir():
        raise ProtocolError(f"{what} {path} exists and is not a folder")
    if not os.access(path, os.W_OK):
        raise ProtocolError(f"{what} {path} is not writable")
    return path
