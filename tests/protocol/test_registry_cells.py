"""The registry's integrity covers its set of cells: a deleted cell record is refused at
preregister and confirm, and the report of the cell it held reads UNCONFIRMED."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol import ledger, prereg, report
from protocol.errors import ProtocolError
from tests.protocol.test_prereg import FakeRunner, new_plan, run_confirm

CELL = "qwen-1.5b@b256"


def _key(plan, cid=CELL):
    cell = next(c for c in plan["cells"] if c["id"] == cid)
    return prereg.cell_key(prereg.cell_identity(plan, cell))


def _confirmed(tmp_path):
    path, h, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    run_confirm(path, tmp_path / "a", FakeRunner(), cells=[CELL])
    return path, h


def _delete_cell_record(cell_key):
    path = ledger.Registry().cell_path(cell_key)
    for p in (path, Path(f"{path}.head"), Path(f"{path}.lock")):
        p.unlink(missing_ok=True)


def test_deleted_cell_record_refuses_a_second_confirmation(tmp_path):
    _confirmed(tmp_path)
    _delete_cell_record(_key(new_plan()))
    with pytest.raises(ProtocolError, match="a cell record was deleted"):
        prereg.write_plan(new_plan(seed=1), tmp_path / "plans2")
    # a plan written elsewhere (another registry) is refused by confirm in this one
    with pytest.raises(ProtocolError, match="a cell record was deleted"):
        ledger.Registry().record_attempt(_key(new_plan()), plan_hash="e" * 64, cell_id=CELL,
                                         status="started", out_dir=str(tmp_path / "b"))


def test_deleted_index_with_cell_records_left_is_damage(tmp_path):
    _confirmed(tmp_path)
    cells = ledger.Registry().root / "cells"
    for name in (ledger.INDEX_NAME, ledger.INDEX_NAME + ".head"):
        (cells / name).unlink()
    with pytest.raises(ProtocolError, match="index of cells was deleted"):
        ledger.Registry().cell_attempts(_key(new_plan()))


def test_cell_file_missing_from_the_index_is_added_back(tmp_path):
    """A kill between a new cell's first line and its index line leaves a file the index lacks."""
    _confirmed(tmp_path)
    reg = ledger.Registry()
    index = reg.root / "cells" / ledger.INDEX_NAME
    lines = index.read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["index", "cell"]
    index.write_text(lines[0] + "\n")
    head = json.loads(lines[0])
    Path(f"{index}.head").write_text(json.dumps({"count": 1, "hash": head["hash"]}))
    assert [a["status"] for a in reg.cell_attempts(_key(new_plan()))] == ["started", "confirmed"]
    assert len(index.read_text().splitlines()) == 2


def test_report_of_a_cell_whose_record_was_deleted_is_unconfirmed(tmp_path):
    _confirmed(tmp_path)
    rep = report.build_report([tmp_path / "a" / "runs"])
    assert rep.comparisons[0]["confirmation"] == "confirmed"
    _delete_cell_record(_key(new_plan()))
    rep = report.build_report([tmp_path / "a" / "runs"])
    row = rep.comparisons[0]
    assert row["verdict"].startswith("UNCONFIRMED") and "cell record was deleted" in row["confirmation"]
    assert report.terminal_summary(rep).startswith("!" * 78)


def test_report_of_a_cell_whose_whole_cell_folder_was_wiped_is_unconfirmed(tmp_path):
    """Deleting every cell record and the index (a partial registry wipe) lets another plan
    through (docs/walkthrough.md: only detectable); the report of the first confirmation detects it."""
    path, h = _confirmed(tmp_path)
    cells = ledger.Registry().root / "cells"
    for p in cells.iterdir():
        p.unlink()
    path2, h2, _ = prereg.write_plan(new_plan(seed=1), tmp_path / "plans2")
    run_confirm(path2, tmp_path / "b", FakeRunner(), cells=[CELL])
    rep = report.build_report([tmp_path / "a" / "runs"])
    row = rep.comparisons[0]
    assert row["verdict"].startswith("UNCONFIRMED")
    assert f"no confirmation of plan {h[:12]}" in row["confirmation"]


def test_a_confirmation_in_a_fresh_registry_reads_unconfirmed_against_the_original(tmp_path, monkeypatch):
    path, h = _confirmed(tmp_path)
    state = ledger.state_dir()
    monkeypatch.setenv(ledger.STATE_ENV, str(tmp_path / "fresh"))
    copy = tmp_path / "copy" / path.name
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    run_confirm(copy, tmp_path / "c", FakeRunner(), cells=[CELL])
    monkeypatch.setenv(ledger.STATE_ENV, str(state))
    rep = report.build_report([tmp_path / "c" / "runs"])
    assert len(rep.comparisons) == 1 and rep.comparisons[0]["verdict"].startswith("UNCONFIRMED")
    assert len(rep.provenance["unconfirmed"]) == 2
    assert all("does not verify" in why for why in rep.provenance["unconfirmed"].values())
