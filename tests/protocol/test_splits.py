"""Frozen splits: counts, reproducibility from the data, refusal of every kind of tampering."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import protocol
from protocol.data import DATASET_SHA256, default_data_path
from protocol.errors import ProtocolError
from protocol.splits import (COUNTS, RULE, SALT, compute_splits, default_splits_dir,
                             load_split, manifest_sha256, problems_by_id, verify_splits,
                             write_splits)

ROOT = Path(protocol.__file__).resolve().parent.parent
COMMITTED = ROOT / "splits" / "math500"


def _ids(name: str, d: Path = COMMITTED) -> list[str]:
    return (d / f"{name}.txt").read_text(encoding="utf-8").splitlines()


@pytest.fixture
def tmp_splits(tmp_path) -> Path:
    d = tmp_path / "splits" / "math500"
    shutil.copytree(COMMITTED, d)
    return d


def _rewrite_manifest(d: Path, **changes) -> None:
    m = json.loads((d / "manifest.json").read_text())
    m.update(changes)
    (d / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_dir_is_the_repository_splits():
    assert default_splits_dir() == ROOT / "splits"
    assert (COMMITTED / "manifest.json").is_file()


def test_committed_splits_verify():
    info = verify_splits()
    assert info["counts"] == {"dev": 201, "confirm": 299} == COUNTS
    assert info["salt"] == SALT and info["rule"] == RULE
    assert info["dataset_sha256"] == DATASET_SHA256
    assert info["manifest_sha256"] == _sha(COMMITTED / "manifest.json") == manifest_sha256()
    for name in ("dev", "confirm"):
        assert info["files"][name]["sha256"] == _sha(COMMITTED / f"{name}.txt")


def test_counts_disjoint_and_cover_all_500():
    dev, confirm = _ids("dev"), _ids("confirm")
    assert (len(dev), len(confirm)) == (201, 299)
    assert len(set(dev)) == 201 and len(set(confirm)) == 299
    assert not set(dev) & set(confirm)
    assert set(dev) | set(confirm) == set(problems_by_id())


def test_lists_reproduce_from_the_data_by_the_written_rule():
    # recomputed here from the rule text, independently of compute_splits
    ids = [json.loads(line)["unique_id"]
           for line in default_data_path().read_text(encoding="utf-8").splitlines()]
    order = sorted(ids, key=lambda u: hashlib.md5((SALT + u).encode()).hexdigest())
    assert _ids("dev") == order[:201]
    assert _ids("confirm") == order[201:]
    assert compute_splits(ids) == {"dev": order[:201], "confirm": order[201:]}


def test_write_splits_reproduces_the_committed_files(tmp_path):
    write_splits(tmp_path)
    for name in ("dev.txt", "confirm.txt", "manifest.json"):
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes()


def test_load_split_returns_problems_in_committed_order():
    dev = load_split("dev")
    assert [p.unique_id for p in dev] == _ids("dev")
    assert len(load_split("confirm")) == 299
    by_id = problems_by_id()
    assert len(by_id) == 500 and all(by_id[p.unique_id] == p for p in dev)


def test_unknown_split_name():
    with pytest.raises(ProtocolError, match="unknown split 'test'"):
        load_split("test")


def test_splits_dir_may_name_the_parent_or_the_math500_directory(tmp_splits):
    assert verify_splits(splits_dir=tmp_splits)["counts"]["dev"] == 201
    assert verify_splits(splits_dir=tmp_splits.parent)["counts"]["dev"] == 201


def test_swapped_ids_are_refused_even_with_a_consistent_manifest(tmp_splits):
    dev, confirm = _ids("dev", tmp_splits), _ids("confirm", tmp_splits)
    dev[5], confirm[7] = confirm[7], dev[5]
    (tmp_splits / "dev.txt").write_text("".join(u + "\n" for u in dev))
    (tmp_splits / "confirm.txt").write_text("".join(u + "\n" for u in confirm))
    m = json.loads((tmp_splits / "manifest.json").read_text())
    m["files"]["dev"]["sha256"] = _sha(tmp_splits / "dev.txt")
    m["files"]["confirm"]["sha256"] = _sha(tmp_splits / "confirm.txt")
    (tmp_splits / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ProtocolError, match=r"dev\.txt differs from the split recomputed from the "
                                            r"data: line 6"):
        verify_splits(splits_dir=tmp_splits)
    with pytest.raises(ProtocolError):
        load_split("dev", splits_dir=tmp_splits)


def test_edited_list_without_manifest_update(tmp_splits):
    ids = _ids("confirm", tmp_splits)
    (tmp_splits / "confirm.txt").write_text("".join(u + "\n" for u in ids[:-1]))
    with pytest.raises(ProtocolError, match=r"confirm\.txt: sha256 [0-9a-f]{64} != manifest"):
        verify_splits(splits_dir=tmp_splits)


@pytest.mark.parametrize("changes, needle", [
    ({"salt": "retention-math500-v2"}, "salt 'retention-math500-v2' != protocol salt"),
    ({"rule": "first 201 ids"}, "rule 'first 201 ids' != protocol rule"),
    ({"dataset_sha256": "0" * 64}, "dataset_sha256 '0000"),
    ({"counts": {"dev": 200, "confirm": 300}}, "counts"),
    ({"note": "added later"}, "field 'note'"),
    ({"dataset": "MATH-5000"}, "field 'dataset'"),
])
def test_tampered_manifest_is_refused(tmp_splits, changes, needle):
    _rewrite_manifest(tmp_splits, **changes)
    with pytest.raises(ProtocolError) as err:
        verify_splits(splits_dir=tmp_splits)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_consistently_regenerated_with_another_salt_is_refused(tmp_splits):
    ids = list(problems_by_id())
    other = compute_splits(ids, salt="another-salt")
    for name in ("dev", "confirm"):
        (tmp_splits / f"{name}.txt").write_text("".join(u + "\n" for u in other[name]))
    m = json.loads((tmp_splits / "manifest.json").read_text())
    m["salt"] = "another-salt"
    for name in ("dev", "confirm"):
        m["files"][name]["sha256"] = _sha(tmp_splits / f"{name}.txt")
    (tmp_splits / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ProtocolError, match="salt 'another-salt' != protocol salt"):
        verify_splits(splits_dir=tmp_splits)


def test_changed_dataset_is_refused(tmp_path):
    rows = default_data_path().read_text(encoding="utf-8").splitlines()
    row = json.loads(rows[42])
    row["answer"] = "42"
    rows[42] = json.dumps(row)
    data = tmp_path / "math500.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(ProtocolError, match=r"canonical sha256 [0-9a-f]{64} != manifest dataset_sha256"):
        verify_splits(data_path=data)
    with pytest.raises(ProtocolError):
        load_split("dev", data_path=data)


def test_missing_files(tmp_splits):
    (tmp_splits / "dev.txt").unlink()
    with pytest.raises(ProtocolError, match="split list not found"):
        verify_splits(splits_dir=tmp_splits)
    (tmp_splits / "manifest.json").unlink()
    with pytest.raises(ProtocolError, match="manifest not found"):
        verify_splits(splits_dir=tmp_splits)
    with pytest.raises(ProtocolError, match="manifest not found"):
        manifest_sha256(tmp_splits)


def test_manifest_hash_is_only_given_for_verified_splits(tmp_splits):
    assert manifest_sha256(tmp_splits) == hashlib.sha256((tmp_splits / "manifest.json").read_bytes()).hexdigest()
    _rewrite_manifest(tmp_splits, note="x")
    with pytest.raises(ProtocolError, match="note"):
        manifest_sha256(tmp_splits)  # a tampered manifest is never hashed into a plan


def test_default_splits_dir_env_and_checkout(tmp_path, monkeypatch):
    from protocol.splits import SPLITS_ENV

    monkeypatch.setenv(SPLITS_ENV, str(tmp_path / "mine"))
    assert default_splits_dir() == tmp_path / "mine"
    monkeypatch.delenv(SPLITS_ENV)
    checkout = tmp_path / "checkout"
    (checkout / "splits" / "math500").mkdir(parents=True)
    (checkout / "splits" / "math500" / "manifest.json").write_text("{}")
    (checkout / "pyproject.toml").write_text("")
    (checkout / "sub").mkdir()
    monkeypatch.chdir(checkout / "sub")
    assert default_splits_dir() == checkout / "splits"


# ------------------------------------------------------------------------------------------ CLI

def _cli():
    from retention.cli import main

    return main


def test_cli_splits_verify_ok():
    res = CliRunner().invoke(_cli(), ["splits", "verify"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("splits OK: dev 201 + confirm 299 ids")
    assert manifest_sha256() in res.output


def test_cli_splits_verify_refuses_tampering_with_one_line(tmp_splits):
    _rewrite_manifest(tmp_splits, salt="x")
    res = CliRunner().invoke(_cli(), ["splits", "verify", "--splits-dir", str(tmp_splits)])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "salt 'x'" in lines[0]
    assert "Traceback" not in res.output


def test_cli_splits_verify_refuses_other_data(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(default_data_path().read_text(encoding="utf-8").replace("\\\\frac", "\\\\dfrac", 1),
                    encoding="utf-8")
    res = CliRunner().invoke(_cli(), ["splits", "verify", "--data", str(data)])
    assert res.exit_code == 1 and "canonical sha256" in res.output


def test_cli_splits_show():
    res = CliRunner().invoke(_cli(), ["splits", "show", "--split", "confirm"])
    assert res.exit_code == 0
    assert res.output.splitlines() == _ids("confirm")
    bad = CliRunner().invoke(_cli(), ["splits", "show", "--split", "test"])
    assert bad.exit_code == 1  # click's usage error, as one Error: line with exit 1
    assert bad.output.strip().splitlines() == [
        "Error: Invalid value for '--split': 'test' is not one of 'dev', 'confirm'."]
