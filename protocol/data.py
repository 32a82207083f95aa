"""The datasets: MATH-500 (typed problems, from a local JSONL file or the `datasets` hub) and
AIME 2024 / AIME 2025 (30 problems each, shipped; `load_dataset`).

Both sources must yield the same rows. "Same" is checked by hashing the *canonical JSONL* of the
rows: one JSON object per line, keys in the order of `FIELDS`, `json.dumps` defaults
(`ensure_ascii=True`, `", "`/`": "` separators), each line ending in `\\n`, rows in dataset order.
The copy shipped in this package (`protocol/resources/math500.jsonl`) is byte-identical to its canonical
form, so its file sha256 equals `DATASET_SHA256`.

The package never needs anything outside itself at run time: the default path is the shipped copy.

AIME (`protocol/resources/aime24.jsonl`, `aime25.jsonl`; source and construction in
`protocol/resources/README.md`): one row per problem in contest order (I 1..15, II 1..15), fields
`AIME_FIELDS`, the answer an integer 0..999 written without leading zeros. Each file's sha256 is
pinned in `AIME_SHA256` and checked on every load; a copy from before a text repair
(`AIME_REPLACED_SHA256`) is named as such.

Beside every shipped file, `<name>.provenance.json` (`provenance_path`) holds the file's sha256 and
its sources; for an AIME set also, per problem, the answer keys its answer was checked against, the
transcription its text was compared with, and every repair of the text with where the intact text
was read. `tests/protocol/test_datasets.py` checks both against the data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal

from protocol.errors import ProtocolError
from protocol.io import read_jsonl

#: sha256 of the canonical JSONL of MATH-500 (protocol section 1).
DATASET_SHA256 = "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
#: The hub copy of the same 500 problems.
HUB_DATASET = "HuggingFaceH4/MATH-500"
HUB_SPLIT = "test"
#: Field order of the canonical JSONL (the order of the PRM800K file).
FIELDS = ("problem", "solution", "answer", "subject", "level", "unique_id")
N_PROBLEMS = 500

_FIELD_TYPES = {"problem": str, "solution": str, "answer": str, "subject": str, "level": int,
                "unique_id": str}


@dataclass(frozen=True)
class Problem:
    """One MATH-500 problem. `answer` is the reference answer (MATH LaTeX, without `\\boxed`)."""

    unique_id: str
    problem: str
    solution: str
    answer: str
    subject: str
    level: int

    def to_row(self) -> dict[str, Any]:
        """The row in canonical field order."""
        d = asdict(self)
        return {k: d[k] for k in FIELDS}


def default_data_path() -> Path:
    """Path of the MATH-500 copy shipped inside the package."""
    return Path(str(resources.files("protocol") / "resources" / "math500.jsonl"))


def _canonical_row(row: dict[str, Any], i: int, origin: str = "MATH-500") -> dict[str, Any]:
    missing = [k for k in FIELDS if k not in row]
    if missing:
        raise ProtocolError(f"{origin}: row {i} lacks field(s) {', '.join(missing)}")
    canon = {k: row[k] for k in FIELDS}
    # the hub stores `level` as an int, some mirrors as a string; both mean the same row
    if isinstance(canon["level"], str) and canon["level"].strip().isdigit():
        canon["level"] = int(canon["level"])
    return canon


def canonical_jsonl(rows: Iterable[dict[str, Any]], origin: str = "MATH-500") -> bytes:
    """Canonical JSONL bytes of `rows` (see the module docstring); the input of the sha256 check.

    Only the fields of `FIELDS` are kept, in that order, so a reordered or extended export of the
    same rows hashes the same.
    """
    return "".join(json.dumps(_canonical_row(r, i, origin)) + "\n"
                   for i, r in enumerate(rows, start=1)).encode("utf-8")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_json_objects(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of a strict JSONL file of JSON objects.

    A file that is not UTF-8, a line that is not JSON or not an object raises `ProtocolError` naming
    the line; a missing file raises `FileNotFoundError` for the caller to word."""
    if not Path(path).exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    return read_jsonl(Path(path), objects=True, tolerate_partial_tail=False).rows


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        return [row for _, row in read_json_objects(path)]
    except FileNotFoundError:
        raise ProtocolError(f"MATH-500 data file not found: {path}") from None


def _hub_rows() -> list[dict[str, Any]]:
    try:
        # deferred: optional dependency (hub extra), heavy: only imported when the hub is asked for
        import datasets
    except ImportError:
        raise ProtocolError(
            "source='hub' needs the `datasets` package (pip install datasets); "
            "or load the shipped copy with source='local'"
        ) from None
    try:
        ds = datasets.load_dataset(HUB_DATASET, split=HUB_SPLIT)
    except Exception as exc:  # network, auth, cache: all end as one clear line
        raise ProtocolError(f"could not load {HUB_DATASET} ({HUB_SPLIT}) from the hub: {exc}") from None
    return [dict(r) for r in ds]


def _to_problems(rows: list[dict[str, Any]], origin: str) -> list[Problem]:
    problems, seen = [], set()
    for i, row in enumerate(rows, start=1):
        canon = _canonical_row(row, i, origin)
        for k, typ in _FIELD_TYPES.items():
            if not isinstance(canon[k], typ) or isinstance(canon[k], bool):
                raise ProtocolError(
                    f"{origin}: row {i} field {k!r} is {type(canon[k]).__name__}, expected {typ.__name__}")
        if canon["unique_id"] in seen:
            raise ProtocolError(f"{origin}: duplicate unique_id {canon['unique_id']!r} (row {i})")
        seen.add(canon["unique_id"])
        problems.append(Problem(**canon))
    return problems


def load_problems(path: str | Path | None = None, *, source: Literal["local", "hub"] = "local",
                  verify: bool = True) -> list[Problem]:
    """Load MATH-500 as a list of `Problem` in dataset order.

    `source="local"` reads `path` (default: the shipped copy); `source="hub"` loads
    `HuggingFaceH4/MATH-500` (test split) through `datasets`, imported only then. With `verify`
    (the default) the canonical JSONL of the rows must hash to `DATASET_SHA256`, otherwise a
    `ProtocolError` names both hashes.
    """
    if source == "local":
        p = Path(path) if path is not None else default_data_path()
        rows, origin = _read_jsonl(p), str(p)
    elif source == "hub":
        if path is not None:
            raise ProtocolError("source='hub' takes no path")
        rows, origin = _hub_rows(), f"{HUB_DATASET}:{HUB_SPLIT}"
    else:
        raise ProtocolError(f"unknown data source {source!r} (expected 'local' or 'hub')")
    if verify:
        got = sha256_hex(canonical_jsonl(rows, origin))
        if got != DATASET_SHA256:
            raise ProtocolError(
                f"MATH-500 from {origin} does not match the protocol: canonical sha256 {got} != "
                f"expected {DATASET_SHA256} ({len(rows)} rows)")
    problems = _to_problems(rows, origin)
    if verify and len(problems) != N_PROBLEMS:  # unreachable with the right hash; kept as a guard
        raise ProtocolError(f"{origin}: {len(problems)} problems, expected {N_PROBLEMS}")
    return problems


# --------------------------------------------------------------------------------------------
# AIME 2024 / 2025
# --------------------------------------------------------------------------------------------

#: Every dataset a run may name (`--dataset`); MATH-500 is the default and the only one with a dev split.
DATASETS = ("math500", "aime24", "aime25")
DEFAULT_DATASET = "math500"
AIME_FIELDS = ("unique_id", "problem", "answer", "year", "exam", "number", "url")
AIME_SHA256 = {
    "aime24": "f0102597295738c468ffce46e9e39e7730bc1df225864216a1758bb2dd78328e",
    "aime25": "baa2c063abcffdc7fa8ffd6ec87eea5b6d03098a0ce49450de42e70e46566e7b",
}
#: Copies shipped before the text repairs of issue 30 (same ids and answers; see the provenance files).
AIME_REPLACED_SHA256 = {
    "aime24": ("a6056ce71c35cbe6bc22d75b814478796efc9ee8fbe7d60d88168ffa13457df8",),
    "aime25": ("7544bad47f56b8891bda9096fb8da734547f0e3c8dd95b62faa5fcc20916a674",),
}
AIME_PROBLEMS = 30
_AIME_TYPES = {"unique_id": str, "problem": str, "answer": str, "year": int, "exam": str, "number": int, "url": str}


@dataclass(frozen=True)
class AimeProblem:
    """One AIME problem: `unique_id` like "2024-II-4", `answer` the integer answer as a string."""

    unique_id: str
    problem: str
    answer: str
    year: int
    exam: str
    number: int
    url: str


def aime_data_path(name: str) -> Path:
    """Path of the shipped copy of AIME dataset `name` ("aime24" or "aime25")."""
    if name not in AIME_SHA256:
        raise ProtocolError(f"unknown AIME dataset {name!r} (expected one of {', '.join(AIME_SHA256)})")
    return Path(str(resources.files("protocol") / "resources" / f"{name}.jsonl"))


def provenance_path(name: str) -> Path:
    """Path of the provenance record of dataset `name`, `<name>.provenance.json` beside its shipped
    copy: sha256 of the data, sources, and for an AIME set the answer keys and repairs per problem."""
    path = default_data_path() if name == DEFAULT_DATASET else aime_data_path(name)
    return path.with_name(f"{name}.provenance.json")


def load_aime(name: str) -> list[AimeProblem]:
    """The 30 problems of `name` in contest order, after checking the file's sha256 and every row."""
    path = aime_data_path(name)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ProtocolError(f"{name} data file not found: {path}") from None
    got = sha256_hex(data)
    if got in AIME_REPLACED_SHA256[name]:
        raise ProtocolError(f"{path}: sha256 {got} is the {name} copy before its text repairs; this code pins "
                            f"{AIME_SHA256[name]} (reinstall the package)")
    if got != AIME_SHA256[name]:
        raise ProtocolError(f"{path}: sha256 {got} != pinned {AIME_SHA256[name]} (the shipped {name} copy changed)")
    problems = []
    for i, row in read_json_objects(path):
        if tuple(row) != AIME_FIELDS or any(type(row[k]) is not t for k, t in _AIME_TYPES.items()):
            raise ProtocolError(f"{path}: line {i} is not an AIME row with fields {', '.join(AIME_FIELDS)}")
        if not (row["answer"].isdigit() and 0 <= int(row["answer"]) <= 999 and str(int(row["answer"])) == row["answer"]):
            raise ProtocolError(f"{path}: line {i} answer {row['answer']!r} is not an integer 0..999")
        problems.append(AimeProblem(**row))
    if len(problems) != AIME_PROBLEMS or len({p.unique_id for p in problems}) != AIME_PROBLEMS:
        raise ProtocolError(f"{path}: {len(problems)} rows with distinct ids expected {AIME_PROBLEMS}")
    return problems


def load_dataset(name: str = DEFAULT_DATASET, path: str | Path | None = None) -> list[Problem] | list[AimeProblem]:
    """All problems of dataset `name` in dataset order, verified. `path` (a MATH-500 copy) applies
    to math500 only: the AIME sets are always the shipped, pinned copies."""
    if name == DEFAULT_DATASET:
        return load_problems(path)
    if name not in DATASETS:
        raise ProtocolError(f"unknown dataset {name!r} (expected one of {', '.join(DATASETS)})")
    if path is not None:
        raise ProtocolError(f"--data gives a MATH-500 copy; {name} is always the shipped copy")
    return load_aime(name)


def dataset_size(name: str) -> int:
    """Problems in dataset `name` (MATH-500: 500; an AIME set: 30), without loading it."""
    if name == DEFAULT_DATASET:
        return N_PROBLEMS
    if name not in DATASETS:
        raise ProtocolError(f"unknown dataset {name!r} (expected one of {', '.join(DATASETS)})")
    return AIME_PROBLEMS


def check_limit(name: str, limit: int | None) -> None:
    """Refuse a `limit` (first N problems) larger than dataset `name`: it would silently run fewer."""
    if limit is not None and limit > dataset_size(name):
        raise ProtocolError(f"--limit {limit} is more than the {dataset_size(name)} problems of {name}")


def dataset_sha256(path: str | Path | None = None, *, source: Literal["local", "hub"] = "local") -> str:
    """sha256 of the canonical JSONL of the data (no verification; for reporting and manifests)."""
    if source == "hub":
        return sha256_hex(canonical_jsonl(_hub_rows()))
    p = Path(path) if path is not None else default_data_path()
    return sha256_hex(canonical_jsonl(_read_jsonl(p), str(p)))
