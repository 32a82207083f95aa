"""Settings no test or confirmation could honour are refused with one error line; a plan the
registry first sees at confirm says so in its deviations."""

from __future__ import annotations

import json

import pytest

from protocol import io, ledger, prereg, report
from protocol.errors import ProtocolError
from tests.protocol.test_prereg import MANIFEST, FakeRunner, new_plan, run_confirm
from tests.protocol.test_report import make_run
from tests.cli import invoke as _cli

CELL = "qwen-1.5b@b256"


def _one_error(res, needle):
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], res.output


def _csv(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("p,t,b\n" + "".join(f"{i},{i % 2},{i % 3 == 0:d}\n" for i in range(20)))
    return path


def test_stats_refuses_one_column_as_both_arms_and_boot_max_below_boot(tmp_path):
    csv = _csv(tmp_path)
    _one_error(_cli("stats", csv, "--treatment", "t", "--baseline", "t", "--cluster", "p"),
               "both name the column 't'")
    _one_error(_cli("stats", csv, "--treatment", "t", "--baseline", "b", "--cluster", "p",
                    "--boot", "500", "--boot-max", "100"), "--boot-max 100 is below --boot 500")
    res = _cli("stats", csv, "--treatment", "t", "--baseline", "b", "--cluster", "p", "--boot", "500",
               "--boot-max", "500")
    assert res.exit_code == 0, res.output


def test_agree_refuses_a_run_compared_with_itself(tmp_path):
    run = make_run(tmp_path, n=3)
    _one_error(_cli("agree", run, run), "are the same run")


def test_report_refuses_boot_max_below_boot(tmp_path):
    make_run(tmp_path / "r", scorer="alpha", n=10)
    make_run(tmp_path / "r", scorer="triattention", n=10, seed=1)
    out = tmp_path / "out"
    _one_error(_cli("report", tmp_path / "r", "--boot", "300", "--boot-max", "100", "--out", out),
               "--boot-max 100 is below --boot 300")
    assert not out.exists()
    with pytest.raises(ProtocolError, match="below --boot 100000"):
        report.build_report([tmp_path / "r"], boot_max=500)


def test_unknown_config_schema_and_boot_max_below_boot_are_refused_in_a_plan(tmp_path):
    with pytest.raises(ProtocolError, match="--config-schema 999 is unknown"):
        new_plan(config_schema=999)
    with pytest.raises(ProtocolError, match="--boot-max 100 is below --boot 2000"):
        new_plan(boot_max=100)
    # a plan file written with schema 999 by hand (hash recomputed) does not confirm either
    plan = dict(new_plan(), config_schema=999)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan_hash": prereg.plan_hash(plan), "registered_at": "2020", "plan": plan}))
    with pytest.raises(ProtocolError, match="configuration schema 999 is unknown"):
        run_confirm(path, tmp_path / "c", FakeRunner(), config_schema=999)
    assert not (tmp_path / "c").exists()


def test_a_plan_first_registered_at_confirm_is_a_deviation_of_each_cell(tmp_path):
    """A plan edited and re-hashed by hand keeps the registered_at it claims; the registry records
    that it first saw the plan at confirm, and each confirmed cell carries the deviation."""
    path, h, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    assert ledger.Registry().registration(h)["by"] == "preregister"
    doc = json.loads(path.read_text())
    edited = dict(doc["plan"], note="edited by hand")
    h2 = prereg.plan_hash(edited)
    forged = tmp_path / "forged.json"
    forged.write_text(json.dumps({"plan_hash": h2, "registered_at": doc["registered_at"], "plan": edited}))
    entry = run_confirm(forged, tmp_path / "c", FakeRunner(), cells=[CELL])[0]
    assert ledger.Registry().registration(h2)["by"] == "confirm"
    devs = [json.loads(x) for x in (tmp_path / "c" / "deviations.jsonl").read_text().splitlines()]
    late = [d for d in devs if d["kind"] == "registered_at_confirm"]
    assert len(late) == 1 and late[0]["planned"] == doc["registered_at"] and late[0]["hash"] in entry["deviations"]
    row = report.build_report([tmp_path / "c" / "runs"]).comparisons[0]
    assert "1 deviation(s) (registered_at_confirm)" in row["confirmation"]
    # the record is keyed: editing it is registry damage
    rec = ledger.Registry().plan_dir(h2) / "registered.json"
    rec.write_text(io.canonical_json(dict(json.loads(rec.read_text()), by="preregister")))
    with pytest.raises(ProtocolError, match="registration record edited"):
        ledger.Registry().registration(h2)


def test_a_plan_preregistered_normally_has_no_registration_deviation(tmp_path):
    path, _, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    run_confirm(path, tmp_path / "c", FakeRunner(), cells=[CELL], manifest_hash=MANIFEST)
    devs = (tmp_path / "c" / "deviations.jsonl")
    assert not devs.exists() or "registered_at_confirm" not in devs.read_text()
