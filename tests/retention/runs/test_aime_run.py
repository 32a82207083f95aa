"""`retention run --dataset aime24|aime25` and the confirm runner on an AIME set, on tiny-random."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol.data import load_aime
from protocol.exploration import explored, explored_ids
from retention.runs.arms import validate_arm
from retention.cli import main
from retention.errors import RetentionError

FAST = ["--scorer", "full", "--temperature", "0", "--quiet"]


def _run(*args):
    return CliRunner().invoke(main, ["run", "--model", "tiny-random", *FAST, *args])


def _only_run(out: Path) -> tuple[dict, list[dict]]:
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    config = json.loads((run_dir / "config.json").read_text())["config"]
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    return config, records


def test_aime_run_writes_records_graded_against_aime_answers(tmp_path):
    res = _run("--dataset", "aime24", "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    config, records = _only_run(tmp_path)
    assert config["dataset"] == "aime24" and config["split"] == "dev"
    assert [r["problem_id"] for r in records] == ["2024-I-1", "2024-I-2"]
    assert [r["gold"] for r in records] == ["204", "25"]  # graded against the AIME answers
    assert all(r["verdict"] in (False, None) for r in records)  # random text
    assert explored_ids("aime24") == {"2024-I-1", "2024-I-2"}
    assert explored("aime24")[0]["config_hashes"] == [json.loads(
        next(tmp_path.iterdir()).joinpath("config.json").read_text())["config_hash"]]


def test_aime_run_covers_all_30_problems(tmp_path):
    res = _run("--dataset", "aime25", "--max-new-tokens", "1", "--batch-size", "30", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    _, records = _only_run(tmp_path)
    assert [r["problem_id"] for r in records] == [p.unique_id for p in load_aime("aime25")]
    assert explored_ids("aime25") == {p.unique_id for p in load_aime("aime25")}
    assert explored("aime24") == []


def test_math500_configuration_has_no_dataset_key(tmp_path):
    res = _run("--limit", "1", "--max-new-tokens", "2", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    config, records = _only_run(tmp_path)
    assert "dataset" not in config and "prompt" not in config  # hashes of earlier runs are kept
    assert records[0]["problem_id"].startswith("test/")
    assert explored("aime24") == [] and explored("math500") == []


def test_data_with_an_aime_set_is_refused_in_one_line(tmp_path):
    data = tmp_path / "m.jsonl"
    data.write_text("")
    res = _run("--dataset", "aime24", "--data", str(data), "--out", str(tmp_path / "o"))
    assert res.exit_code != 0 and "MATH-500 copy" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", ["aime23", "math500", 5])
def test_arm_dataset_values_are_validated(bad):
    with pytest.raises(RetentionError, match="--dataset must be one of"):
        validate_arm({"model": "tiny-random", "scorer": "full", "dataset": bad})


def test_confirm_runner_runs_the_whole_aime_set_as_confirm(tmp_path):
    from retention.runs.jobs import confirm_runner

    cfg = {"scorer": "full", "scorer_params": {}, "model": "tiny-random", "budget": None, "samples": 1, "seed": 0,
           "max_new_tokens": 1, "temperature": 0.0, "split": "confirm", "plan_hash": "0" * 64, "dataset": "aime24",
           "limit": 3}
    run_dir = confirm_runner({"id": "c1", "model": "tiny-random", "budget": None}, "treatment", cfg, tmp_path)
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config["dataset"] == "aime24" and config["split"] == "confirm"
    ids = [json.loads(line)["problem_id"] for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert ids == ["2024-I-1", "2024-I-2", "2024-I-3"]
    assert explored("aime24") == []  # a confirmation is not an exploration


def test_a_limit_above_an_aime_set_is_refused(tmp_path):
    """AIME years have 30 problems: --limit 100 would silently run 30."""
    res = _run("--dataset", "aime24", "--limit", "100", "--max-new-tokens", "4", "--out", str(tmp_path))
    assert res.exit_code == 1 and "--limit 100 is more than the 30 problems of aime24" in res.output
    assert not any(tmp_path.iterdir())
