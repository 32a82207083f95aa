"""`report` checks what it counts: a config.json that no longer hashes to its configuration hash is
refused (one line naming the run), and a stored verdict that differs from a re-grade of its text is
marked and named (issue 45)."""

import json
import shutil

import pytest
from click.testing import CliRunner

from protocol import grading
from protocol.verdicts import VERDICT_CHECK, check_verdicts
from retention.cli import main

ARGS = ["--model", "tiny-random", "--quiet", "--budget", "40", "--interval", "8", "--limit", "3",
        "--samples", "1", "--max-new-tokens", "12", "--temperature", "0", "--batch-size", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    res = CliRunner().invoke(main, ["run", *ARGS, "--scorer", "streaming", "--baseline", "full", "--out", str(out)])
    assert res.exit_code == 0, res.output
    dirs = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(dirs) == 2
    return dirs


def _copies(runs, tmp_path):
    out = tmp_path / "copy"
    for d in runs:
        shutil.copytree(d, out / d.name)
    return sorted(p for p in out.iterdir())


def _report(dirs, tmp_path):
    return CliRunner().invoke(main, ["report", *map(str, dirs), "--out", str(tmp_path / "rep"), "--boot", "200"])


def test_records_note_the_grader_version(runs):
    recs = [json.loads(line) for line in (runs[0] / "records.jsonl").read_text().splitlines()]
    assert recs and all(r["grader_version"] == grading.GRADER_VERSION for r in recs)


def test_an_edited_configuration_is_refused_naming_the_run(runs, tmp_path):
    dirs = _copies(runs, tmp_path)
    meta = json.loads((dirs[1] / "config.json").read_text())
    meta["config"]["model"] = "qwen2.5-7b"  # shown as another model, its hash left as it was
    (dirs[1] / "config.json").write_text(json.dumps(meta))
    res = _report(dirs, tmp_path)
    assert res.exit_code != 0
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in res.output
    assert f"run {dirs[1].name}: config.json does not hash to its configuration hash" in lines[0]
    assert not (tmp_path / "rep").exists()


def test_an_edited_verdict_is_marked_and_named(runs, tmp_path):
    dirs = _copies(runs, tmp_path)
    path = dirs[0] / "records.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["verdict"] is not True for r in recs)  # a tiny random model answers nothing right
    for r in recs:
        r["verdict"] = True  # every verdict of the run set to true
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = _report(dirs, tmp_path)
    assert res.exit_code == 0, res.output
    (note,) = [ln for ln in res.output.splitlines() if ln.startswith(f"note: VERDICTS {dirs[0].name}:")]
    assert f"{len(recs)} record(s) whose stored verdict differs from a re-grade of their text " \
           f"({len(recs)} under the grader version they record ({grading.GRADER_VERSION}): edited" in note
    assert f"{recs[0]['problem_id']} sample 0 (stored True, re-graded" in note
    assert not [ln for ln in res.output.splitlines() if ln.startswith(f"note: VERDICTS {dirs[1].name}")]


class _Run:
    def __init__(self, name, records):
        self.path = type("P", (), {"name": name})()
        self.records = records


def test_check_verdicts_marks_only_differing_records():
    problem = "Evaluate $\\sqrt{242}$ in simplest form."
    recs = [
        {"problem_id": "p", "sample": 0, "text": "$\\boxed{11\\sqrt{2}}$", "gold": "11\\sqrt2", "verdict": True},
        {"problem_id": "p", "sample": 1, "text": "$\\boxed{\\sqrt{242}}$", "gold": "11\\sqrt2", "verdict": True},
        {"problem_id": "p", "sample": 2, "text": "we get $7$ then", "gold": "7", "verdict": True,
         "finish_reason": "length", "grader_version": grading.GRADER_VERSION},
        {"problem_id": "p", "sample": 3, "text": "x", "gold": "7", "verdict": None, "reason": None, "rule": None},
    ]
    notes = check_verdicts([_Run("r", recs)], {"p": problem})
    assert [VERDICT_CHECK in r for r in recs] == [False, True, True, False]
    assert len(notes) == 1 and notes[0].startswith("VERDICTS r: 2 record(s)")
    assert "(1 under the grader version they record" in notes[0] and "1 under another or none" in notes[0]
