"""AIME 2024 / 2025: the shipped data (checksum, counts, answers), AIME-style grading, the split
manifests (no dev split, the whole set is the confirm set) and the exploration registry."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from protocol import data as data_module
from protocol.data import AIME_SHA256, DATASETS, load_aime, load_dataset
from protocol.errors import ProtocolError
from protocol.exploration import explored, explored_ids, record_exploration, registry_path
from protocol.grading import grade
from protocol.splits import exploration_problems, load_split, manifest_sha256, run_problems, verify_splits

ROOT = Path(__file__).resolve().parents[2]

# The answer keys (MAA, as transcribed in the keys that protocol/resources/<name>.provenance.json cites),
# contest I problems 1..15 then contest II problems 1..15.
KEYS = {
    "aime24": [204, 25, 809, 116, 104, 294, 540, 197, 480, 113, 371, 385, 110, 104, 721,
               73, 236, 45, 33, 80, 55, 699, 127, 902, 468, 601, 23, 321, 211, 315],
    "aime25": [70, 588, 16, 117, 279, 504, 821, 77, 62, 81, 259, 510, 204, 60, 735,
               468, 49, 82, 106, 336, 293, 237, 610, 149, 907, 113, 19, 248, 104, 240],
}


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_shipped_aime_sets(name):
    problems = load_aime(name)
    year = 2000 + int(name[-2:])
    assert [p.unique_id for p in problems] == [f"{year}-{exam}-{n}" for exam in ("I", "II") for n in range(1, 16)]
    assert [int(p.answer) for p in problems] == KEYS[name]
    assert all(p.answer == str(int(p.answer)) and 0 <= int(p.answer) <= 999 for p in problems)
    assert all(p.year == year and len(p.problem) > 50 and "artofproblemsolving.com" in p.url for p in problems)
    path = ROOT / "protocol" / "resources" / f"{name}.jsonl"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == AIME_SHA256[name]
    assert load_dataset(name) == problems


def test_a_changed_aime_copy_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "aime24.jsonl"
    text = data_module.aime_data_path("aime24").read_text()
    copy.write_text(text.replace('"answer": "204"', '"answer": "205"', 1))
    monkeypatch.setattr(data_module, "aime_data_path", lambda name: copy)
    with pytest.raises(ProtocolError, match="sha256 .* != pinned"):
        load_aime("aime24")


def test_unknown_dataset_and_data_path_for_aime_are_refused():
    with pytest.raises(ProtocolError, match="unknown dataset"):
        load_dataset("aime23")
    with pytest.raises(ProtocolError, match="MATH-500 copy"):
        load_dataset("aime25", path="x.jsonl")
    assert DATASETS == ("math500", "aime24", "aime25")


@pytest.mark.parametrize("output, gold, right", [
    ("so the answer is \\boxed{033}", "33", True),
    ("\\boxed{33}", "33", True),
    ("\\boxed{025}", "25", True),
    ("\\boxed{25}", "025", True),
    ("\\boxed{34}", "33", False),
    ("\\boxed{330}", "33", False),
    ("\\boxed{0}", "0", True),
])
def test_aime_integer_answers_are_graded(output, gold, right):
    assert grade(output, gold).verdict is right


# --------------------------------------------------------------------------------------------
# Splits: no dev split, the whole set is the confirm set; MATH-500's split is unchanged
# --------------------------------------------------------------------------------------------


def test_math500_split_manifest_is_unchanged():
    # the hash every existing plan recorded
    assert manifest_sha256() == hashlib.sha256((ROOT / "splits" / "math500" / "manifest.json").read_bytes()).hexdigest()
    assert manifest_sha256() == "ac7a4c132f09c340b7846e1052e3cb43aacf152071496c5f8c02089b029db0ac"
    assert len(exploration_problems()) == 201 and run_problems("dev") == load_split("dev")


@pytest.mark.parametrize("name", ["aime24", "aime25"])
def test_aime_manifest_covers_the_whole_set_as_confirm(name):
    info = verify_splits(dataset=name)
    assert info["counts"] == {"dev": 0, "confirm": 30} and info["dataset_sha256"] == AIME_SHA256[name]
    confirm = load_split("confirm", dataset=name)
    assert confirm == load_aime(name) == exploration_problems(name) == run_problems("dev", name)
    with pytest.raises(ProtocolError, match="no dev split: tune on MATH-500 dev"):
        load_split("dev", dataset=name)


def test_splits_dir_of_another_dataset_points_to_its_sibling():
    assert verify_splits(splits_dir=ROOT / "splits" / "math500", dataset="aime25")["dataset"] == "AIME 2025"
    assert verify_splits(splits_dir=ROOT / "splits", dataset="aime25")["dataset"] == "AIME 2025"


def test_a_tampered_aime_list_is_refused(tmp_path):
    shutil.copytree(ROOT / "splits", tmp_path / "splits")
    d = tmp_path / "splits" / "aime24"
    ids = (d / "confirm.txt").read_text().splitlines()
    (d / "confirm.txt").write_text("".join(u + "\n" for u in ids[1:]))
    with pytest.raises(ProtocolError, match="differs from the aime24 problems"):
        load_split("confirm", splits_dir=tmp_path / "splits", dataset="aime24")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["counts"]["dev"] = 5
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ProtocolError, match="field 'counts'"):
        verify_splits(splits_dir=tmp_path / "splits", dataset="aime24")


# --------------------------------------------------------------------------------------------
# The exploration registry
# --------------------------------------------------------------------------------------------


def test_exploration_registry_remembers_each_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path))
    assert explored("aime24") == [] and explored_ids("aime24") == set()
    record_exploration("aime24", ["2024-I-1", "2024-I-2"], ["abc"])
    record_exploration("aime24", ["2024-I-2", "2024-II-9"])
    assert registry_path("aime24") == tmp_path / "explored" / "aime24.jsonl"
    entries = explored("aime24")
    assert [e["problem_ids"] for e in entries] == [["2024-I-1", "2024-I-2"], ["2024-I-2", "2024-II-9"]]
    assert entries[0]["config_hashes"] == ["abc"] and entries[0]["dataset"] == "aime24"
    assert explored_ids("aime24") == {"2024-I-1", "2024-I-2", "2024-II-9"}
    assert explored("aime25") == []


def test_a_torn_line_loses_only_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path))
    record_exploration("aime25", ["2025-I-1"])
    with open(registry_path("aime25"), "a") as fh:
        fh.write('{"dataset": "aime25", "problem_ids": ["2025-I-')  # a killed writer
    record_exploration("aime25", ["2025-II-3"])
    assert explored_ids("aime25") == {"2025-I-1", "2025-II-3"}


def test_bad_exploration_input_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path))
    with pytest.raises(ProtocolError):
        record_exploration("aime24", [])
    with pytest.raises(ProtocolError, match="unknown dataset"):
        record_exploration("aime99", ["x"])
