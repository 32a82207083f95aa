"""Frozen dev/confirm splits of MATH-500 (protocol section 2).

Rule: ``h = md5(salt + unique_id)`` (hex); sort the 500 ids by ``h`` (ties, which md5 makes
practically impossible, by id); the first 201 are ``dev``, the other 299 ``confirm``.

Committed files, at the repository root under ``splits/math500/``:

* ``dev.txt``, ``confirm.txt``: one ``unique_id`` per line, in hash order, ``\\n``-terminated;
* ``manifest.json``: rule, salt, dataset sha256, counts and the sha256 of each list.

`load_split` is the only way a run gets its problems: it first recomputes everything from the data
(`verify_splits`) and refuses, with a `ProtocolError` naming the first difference, when a list, the
manifest, the salt or the dataset has changed.

The AIME sets (30 problems each) are too small to split: there is no dev split (tune on MATH-500 dev)
and the whole set is the confirm set, listed in ``splits/<aime24|aime25>/confirm.txt`` (dataset
order) with its own manifest (`AIME_RULE`). `retention run --dataset aime24` may still explore the
whole set (`exploration_problems`); `protocol.exploration` remembers it, so that a confirmation on an
explored set is flagged.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import protocol
from protocol.data import (AIME_PROBLEMS, AIME_SHA256, DATASET_SHA256, DEFAULT_DATASET, DATASETS, N_PROBLEMS,
                           Problem, dataset_sha256, load_aime, load_problems)
from protocol.errors import ProtocolError
from protocol.io import load_json_object

SALT = "retention-math500-v1"
RULE = ("h = md5(salt + unique_id) (hex); sort ids by h (ties by id); "
        "first 201 = dev, the other 299 = confirm")
SPLIT_NAMES = ("dev", "confirm")
COUNTS = {"dev": 201, "confirm": N_PROBLEMS - 201}
DATASET_NAME = "MATH-500"
MANIFEST = "manifest.json"
SUBDIR = "math500"


SPLITS_ENV = "RETENTION_SPLITS_DIR"


def _holds_manifest(d: Path) -> bool:
    return (d / MANIFEST).is_file() or (d / SUBDIR / MANIFEST).is_file()


def default_splits_dir() -> Path:
    """Where the committed splits are read from, first match wins:

    1. `$RETENTION_SPLITS_DIR`;
    2. `splits/` of the checkout the command runs in (the working directory or a parent holding
       `pyproject.toml` and `splits/`), so a checkout's own lists are what it verifies against;
    3. `splits/` beside the installed `protocol` package.
    """
    env = os.environ.get(SPLITS_ENV)
    if env:
        return Path(env)
    cwd = Path.cwd()
    for d in (cwd, *cwd.parents):
        if (d / "pyproject.toml").is_file() and _holds_manifest(d / "splits"):
            return d / "splits"
    return Path(protocol.__file__).resolve().parent.parent / "splits"


def _split_dir(splits_dir: str | Path | None, dataset: str = DEFAULT_DATASET) -> Path:
    """The directory holding the manifest of `dataset`: `splits_dir` itself or its `<dataset>/`
    child (a `splits_dir` naming another dataset's directory points to its sibling)."""
    base = Path(splits_dir) if splits_dir is not None else default_splits_dir()
    if (base / MANIFEST).is_file():
        return base if dataset == DEFAULT_DATASET or base.name == dataset else base.parent / dataset
    return base / dataset


def split_hash(unique_id: str, salt: str = SALT) -> str:
    return hashlib.md5((salt + unique_id).encode("utf-8")).hexdigest()


def compute_splits(ids: list[str], salt: str = SALT) -> dict[str, list[str]]:
    """Apply the rule to `ids`: {"dev": first 201 by hash, "confirm": the rest}."""
    order = sorted(ids, key=lambda u: (split_hash(u, salt), u))
    n_dev = COUNTS["dev"]
    return {"dev": order[:n_dev], "confirm": order[n_dev:]}


def _list_bytes(ids: list[str]) -> bytes:
    return "".join(u + "\n" for u in ids).encode("utf-8")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_manifest(splits: dict[str, list[str]], salt: str = SALT,
                   data_sha256: str = DATASET_SHA256) -> dict[str, Any]:
    return {
        "dataset": DATASET_NAME,
        "dataset_sha256": data_sha256,
        "rule": RULE,
        "salt": salt,
        "counts": {name: len(splits[name]) for name in SPLIT_NAMES},
        "files": {name: {"path": f"{name}.txt", "sha256": _sha(_list_bytes(splits[name]))}
                  for name in SPLIT_NAMES},
    }


def write_splits(splits_dir: str | Path, data_path: str | Path | None = None) -> dict[str, Any]:
    """Write `dev.txt`, `confirm.txt` and `manifest.json` into `splits_dir` (a maintainer tool:
    the committed files were made with it; runs only ever read them)."""
    out = Path(splits_dir)
    out.mkdir(parents=True, exist_ok=True)
    problems = load_problems(data_path)
    splits = compute_splits([p.unique_id for p in problems])
    for name in SPLIT_NAMES:
        (out / f"{name}.txt").write_bytes(_list_bytes(splits[name]))
    manifest = build_manifest(splits)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _read_manifest(d: Path) -> dict[str, Any]:
    try:
        return load_json_object(d / MANIFEST, "split manifest")
    except ProtocolError as exc:
        raise ProtocolError(f"split manifest: {exc}") from None


def _first_difference(got: list[str], want: list[str]) -> str:
    for i, (a, b) in enumerate(zip(got, want), start=1):
        if a != b:
            return f"line {i} is {a!r}, the rule gives {b!r}"
    return f"{len(got)} ids, the rule gives {len(want)}"


def verify_splits(data_path: str | Path | None = None,
                  splits_dir: str | Path | None = None, dataset: str = DEFAULT_DATASET) -> dict[str, Any]:
    """Recompute the splits of `dataset` from the data and check every committed file against them.

    Returns the manifest (plus `manifest_sha256` and `splits_dir`) when all agree; raises
    `ProtocolError` with a one-line message naming the first difference otherwise.
    """
    _check_dataset(dataset)
    if dataset != DEFAULT_DATASET:
        if data_path is not None:
            raise ProtocolError(f"--data gives a MATH-500 copy; {dataset} is always the shipped copy")
        return _verify_aime_splits(dataset, _split_dir(splits_dir, dataset))
    d = _split_dir(splits_dir)
    manifest = _read_manifest(d)
    where = d / MANIFEST

    # The manifest must state this protocol: a changed salt or rule is a different split.
    if manifest.get("salt") != SALT:
        raise ProtocolError(f"{where}: salt {manifest.get('salt')!r} != protocol salt {SALT!r}")
    if manifest.get("rule") != RULE:
        raise ProtocolError(f"{where}: rule {manifest.get('rule')!r} != protocol rule {RULE!r}")
    if manifest.get("dataset_sha256") != DATASET_SHA256:
        raise ProtocolError(f"{where}: dataset_sha256 {manifest.get('dataset_sha256')!r} != "
                            f"protocol dataset sha256 {DATASET_SHA256}")
    counts = manifest.get("counts")
    if counts != COUNTS:
        raise ProtocolError(f"{where}: counts {counts!r} != protocol counts {COUNTS!r}")

    # The data actually loaded must be that dataset.
    got_sha = dataset_sha256(data_path)
    if got_sha != DATASET_SHA256:
        src = data_path if data_path is not None else "the shipped copy"
        raise ProtocolError(f"dataset {src}: canonical sha256 {got_sha} != manifest "
                            f"dataset_sha256 {DATASET_SHA256}")
    problems = load_problems(data_path)
    expected = compute_splits([p.unique_id for p in problems])

    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ProtocolError(f"{where}: 'files' missing or not an object")
    for name in SPLIT_NAMES:
        entry = files.get(name)
        if not isinstance(entry, dict) or entry.get("path") != f"{name}.txt":
            raise ProtocolError(f"{where}: files.{name} must be {{'path': '{name}.txt', 'sha256': ...}},"
                                f" got {entry!r}")
        path = d / entry["path"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ProtocolError(f"split list not found: {path}") from None
        sha = _sha(data)
        if sha != entry.get("sha256"):
            raise ProtocolError(f"{path}: sha256 {sha} != manifest {entry.get('sha256')}")
        want = _list_bytes(expected[name])
        if data != want:
            got_ids = data.decode("utf-8", errors="replace").splitlines()
            raise ProtocolError(f"{path} differs from the split recomputed from the data: "
                                f"{_first_difference(got_ids, expected[name])}")
        if entry["sha256"] != _sha(want):  # unreachable once the bytes agree; explicit for clarity
            raise ProtocolError(f"{where}: files.{name}.sha256 does not match the recomputed list")

    # Anything else in the manifest (an added or edited field) is a difference too.
    want_manifest = build_manifest(expected)
    for key in sorted(set(manifest) | set(want_manifest)):
        if manifest.get(key) != want_manifest.get(key):
            raise ProtocolError(f"{where}: field {key!r} is {manifest.get(key)!r}, "
                                f"the protocol gives {want_manifest.get(key)!r}")

    out = dict(manifest)
    out["manifest_sha256"] = _sha((d / MANIFEST).read_bytes())
    out["splits_dir"] = str(d)
    return out


def manifest_sha256(splits_dir: str | Path | None = None, data_path: str | Path | None = None,
                    dataset: str = DEFAULT_DATASET) -> str:
    """sha256 of the committed `manifest.json` bytes (what a pre-registered plan records), after
    verifying the lists against the data: a tampered split is refused, never registered."""
    return verify_splits(data_path, splits_dir, dataset)["manifest_sha256"]


def problems_by_id(data_path: str | Path | None = None) -> dict[str, Problem]:
    """All verified MATH-500 problems keyed by `unique_id`."""
    return {p.unique_id: p for p in load_problems(data_path)}


def split_ids(name: str, data_path: str | Path | None = None,
              splits_dir: str | Path | None = None, dataset: str = DEFAULT_DATASET) -> list[str]:
    """The verified id list of split `name` of `dataset`, in committed order."""
    if name not in SPLIT_NAMES:
        raise ProtocolError(f"unknown split {name!r} (expected one of {', '.join(SPLIT_NAMES)})")
    info = verify_splits(data_path, splits_dir, dataset)
    if name not in info["files"]:
        raise ProtocolError(f"{dataset} has no {name} split: tune on MATH-500 dev; its whole set is the confirm "
                            f"set (`retention run --dataset {dataset}` explores it, and that is recorded)")
    path = Path(info["splits_dir"]) / info["files"][name]["path"]
    return path.read_text(encoding="utf-8").splitlines()


def load_split(name: str, data_path: str | Path | None = None,
               splits_dir: str | Path | None = None, dataset: str = DEFAULT_DATASET) -> list:
    """The problems of split `name` ("dev" or "confirm") of `dataset` in committed order, after
    `verify_splits`."""
    ids = split_ids(name, data_path, splits_dir, dataset)
    by_id = problems_by_id(data_path) if dataset == DEFAULT_DATASET else {p.unique_id: p for p in load_aime(dataset)}
    return [by_id[u] for u in ids]


def exploration_problems(dataset: str = DEFAULT_DATASET, data_path: str | Path | None = None,
                         splits_dir: str | Path | None = None) -> list:
    """The problems `retention run` may explore: MATH-500's dev split; an AIME set has none, so its
    whole (verified) confirm set, which `protocol.exploration` then records as seen."""
    if dataset == DEFAULT_DATASET:
        return load_split("dev", data_path, splits_dir)
    return load_split("confirm", data_path, splits_dir, dataset)


def run_problems(split: str, dataset: str = DEFAULT_DATASET, data_path: str | Path | None = None,
                 splits_dir: str | Path | None = None) -> list:
    """The problems a run of `split` on `dataset` decodes (a run configuration's `split` and
    `dataset`, absent meaning math500): the exploration problems for dev, the confirm split else."""
    if split == "dev":
        return exploration_problems(dataset, data_path, splits_dir)
    return load_split(split, data_path, splits_dir, dataset)


# --------------------------------------------------------------------------------------------
# AIME: one confirm list, the whole set in dataset order
# --------------------------------------------------------------------------------------------

AIME_RULE = "no dev split (tune on MATH-500 dev); confirm = every problem, in dataset order"
_AIME_NAMES = {"aime24": "AIME 2024", "aime25": "AIME 2025"}


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASETS:
        raise ProtocolError(f"unknown dataset {dataset!r} (expected one of {', '.join(DATASETS)})")


def build_aime_manifest(dataset: str, ids: list[str]) -> dict[str, Any]:
    return {
        "dataset": _AIME_NAMES[dataset],
        "dataset_sha256": AIME_SHA256[dataset],
        "rule": AIME_RULE,
        "counts": {"dev": 0, "confirm": len(ids)},
        "files": {"confirm": {"path": "confirm.txt", "sha256": _sha(_list_bytes(ids))}},
    }


def write_aime_splits(dataset: str, splits_dir: str | Path) -> dict[str, Any]:
    """Write `confirm.txt` and `manifest.json` of an AIME set into `splits_dir` (maintainer tool)."""
    out = Path(splits_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [p.unique_id for p in load_aime(dataset)]
    (out / "confirm.txt").write_bytes(_list_bytes(ids))
    manifest = build_aime_manifest(dataset, ids)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _verify_aime_splits(dataset: str, d: Path) -> dict[str, Any]:
    """The committed AIME list and manifest against the (sha256-verified) shipped data."""
    manifest = _read_manifest(d)
    ids = [p.unique_id for p in load_aime(dataset)]
    want = build_aime_manifest(dataset, ids)
    for key in sorted(set(manifest) | set(want)):
        if manifest.get(key) != want.get(key):
            raise ProtocolError(f"{d / MANIFEST}: field {key!r} is {manifest.get(key)!r}, "
                                f"the protocol gives {want.get(key)!r}")
    path = d / "confirm.txt"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ProtocolError(f"split list not found: {path}") from None
    if data != _list_bytes(ids):
        raise ProtocolError(f"{path} differs from the {dataset} problems in dataset order: "
                            f"{_first_difference(data.decode('utf-8', errors='replace').splitlines(), ids)}")
    assert len(ids) == AIME_PROBLEMS  # load_aime guarantees it
    out = dict(manifest)
    out["manifest_sha256"] = _sha((d / MANIFEST).read_bytes())
    out["splits_dir"] = str(d)
    return out
