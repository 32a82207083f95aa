"""MATH-500 loading: the shipped copy, canonicalisation, the hub path (with a stand-in module)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

import protocol
from protocol.data import (DATASET_SHA256, FIELDS, Problem, canonical_jsonl, dataset_sha256,
                           default_data_path, load_problems)
from protocol.errors import ProtocolError

ROOT = Path(protocol.__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data" / "math500.jsonl"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_shipped_copy_lives_in_the_package_and_has_the_protocol_hash():
    path = default_data_path()
    assert path.resolve().is_relative_to(Path(protocol.__file__).resolve().parent)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == DATASET_SHA256


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="shared reference copy not present")
def test_shipped_copy_is_byte_identical_to_the_shared_reference():
    assert default_data_path().read_bytes() == SHARED_DATA.read_bytes()


def test_canonicalisation_reproduces_the_file_bytes():
    path = default_data_path()
    assert canonical_jsonl(_rows(path)) == path.read_bytes()


def test_canonical_hash_ignores_key_order_extra_fields_and_string_levels():
    rows = _rows(default_data_path())
    shuffled = [dict(reversed(list(r.items())), extra="x", level=str(r["level"])) for r in rows]
    assert hashlib.sha256(canonical_jsonl(shuffled)).hexdigest() == DATASET_SHA256


def test_load_problems_types_and_counts():
    problems = load_problems()
    assert len(problems) == 500
    assert all(isinstance(p, Problem) for p in problems)
    assert len({p.unique_id for p in problems}) == 500
    assert all(isinstance(p.level, int) and 1 <= p.level <= 5 for p in problems)
    # the distribution documented with the data
    assert Counter(p.subject for p in problems) == {
        "Algebra": 124, "Intermediate Algebra": 97, "Prealgebra": 82, "Number Theory": 62,
        "Precalculus": 56, "Geometry": 41, "Counting & Probability": 38}
    assert Counter(p.level for p in problems) == {1: 43, 2: 90, 3: 105, 4: 128, 5: 134}
    assert problems[0].to_row() == _rows(default_data_path())[0]
    assert list(problems[0].to_row()) == list(FIELDS)


def test_dataset_sha256_of_shipped_copy():
    assert dataset_sha256() == DATASET_SHA256


def test_a_changed_answer_is_refused_with_both_hashes(tmp_path):
    rows = _rows(default_data_path())
    rows[17]["answer"] = rows[17]["answer"] + "1"
    bad = tmp_path / "math500.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    got = dataset_sha256(bad)
    assert got != DATASET_SHA256
    with pytest.raises(ProtocolError) as err:
        load_problems(bad)
    assert got in str(err.value) and DATASET_SHA256 in str(err.value) and str(bad) in str(err.value)
    assert len(load_problems(bad, verify=False)) == 500


def test_a_reformatted_copy_loads(tmp_path):
    rows = _rows(default_data_path())
    copy = tmp_path / "pretty.jsonl"
    copy.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n\n" for r in rows),
                    encoding="utf-8")
    assert load_problems(copy) == load_problems()


@pytest.mark.parametrize("content, needle", [
    ('{"problem": 1\n', ":1: not valid JSON"),
    ("[1, 2]\n", "expected a JSON object"),
    ('{"problem": "p"}\n', "lacks field(s)"),
])
def test_malformed_files_give_one_clear_error(tmp_path, content, needle):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(ProtocolError, match="bad.jsonl") as err:
        load_problems(bad)
    assert needle in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ProtocolError, match="not found"):
        load_problems(tmp_path / "nope.jsonl")


def test_hub_without_datasets_package_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ProtocolError, match="datasets"):
        load_problems(source="hub")


def _fake_datasets(rows):
    mod = types.ModuleType("datasets")
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        return rows

    mod.load_dataset = load_dataset
    mod.calls = calls
    return mod


def test_hub_rows_are_canonicalised_and_verified(monkeypatch):
    # the hub returns the same rows with its own column order; the hash must still match
    rows = [{"unique_id": r["unique_id"], "level": r["level"], "answer": r["answer"],
             "subject": r["subject"], "solution": r["solution"], "problem": r["problem"]}
            for r in _rows(default_data_path())]
    fake = _fake_datasets(rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_problems(source="hub") == load_problems()
    assert fake.calls == [("HuggingFaceH4/MATH-500", "test")]


def test_hub_rows_that_differ_are_refused(monkeypatch):
    rows = _rows(default_data_path())
    rows[3] = dict(rows[3], problem=rows[3]["problem"] + " ")
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(rows))
    with pytest.raises(ProtocolError, match="HuggingFaceH4/MATH-500:test.*canonical sha256"):
        load_problems(source="hub")


def test_unknown_source():
    with pytest.raises(ProtocolError, match="unknown data source"):
        load_problems(source="s3")


def test_protocol_never_imports_retention():
    code = ("import sys, protocol.data, protocol.splits, protocol.grading, "
            "protocol.grading.equivalence, protocol.grading.worker; "
            "print(sorted(m for m in sys.modules if m == 'retention' or m.startswith('retention.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    assert out.stdout.strip() == "[]"
    for src in (ROOT / "protocol").rglob("*.py"):
        text = src.read_text(encoding="utf-8")
        assert "import retention" not in text and "from retention" not in text, src
