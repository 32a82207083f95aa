"""A plan that confirms on AIME: the whole 30-problem set is its confirm set, the plan names AIME's
own split manifest, and a confirmation on a set explored before with `retention run --dataset` is
flagged "confirm set seen during exploration" in the report."""

from __future__ import annotations

import csv
import json

from click.testing import CliRunner

from protocol.splits import manifest_sha256
from retention.cli import main


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


def report_rows(path):
    with open(path / "report.csv", newline="") as f:
        return list(csv.DictReader(f))


def _study(tmp_path, explore: bool):
    common = {"interval": 8, "temperature": 0.7, "limit": 2}
    if explore:
        cli("run", "--model", "tiny-random", "--dataset", "aime24", "--scorer", "streaming", "--budget", 64,
            "--limit", 3, "--max-new-tokens", 4, "--out", tmp_path / "explore", "--quiet")
    cli("preregister", "--out", tmp_path / "plans", "--dataset", "aime24", "--model", "tiny-random", "--budget", 64,
        "--treatment", json.dumps(dict(common, scorer="streaming")), "--baseline", json.dumps(dict(common, scorer="random")),
        "-k", 2, "--max-new-tokens", 6, "--boot", 500, "--boot-max", 500)
    (plan,) = (tmp_path / "plans").glob("plan-*.json")
    body = json.loads(plan.read_text())["plan"]
    assert body["dataset"] == "aime24"
    assert body["split_manifest_sha256"] == manifest_sha256(dataset="aime24") != manifest_sha256()
    cli("confirm", "--plan", plan, "--out", tmp_path / "confirm")
    cli("report", tmp_path / "confirm" / "runs", "--out", tmp_path / "report")
    (row,) = report_rows(tmp_path / "report")
    return row


def test_confirming_on_an_explored_aime_set_is_flagged(tmp_path):
    row = _study(tmp_path, explore=True)
    assert row["confirmation"].startswith("confirmed")
    assert "confirm set seen during exploration (2 of 2 problems)" in row["confirmation"]


def test_an_unexplored_aime_confirmation_is_not_flagged(tmp_path):
    row = _study(tmp_path, explore=False)
    assert row["confirmation"] == "confirmed"
