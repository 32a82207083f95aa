"""`retention run`: run directories, resume after a crash, and one-line errors on bad input."""

import json
import re

import pytest
from click.testing import CliRunner

from retention.cli import main

VOLATILE = {"wall_seconds", "tokens_per_second"}


def _records(run_dir):
    lines = (run_dir / "records.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE} for line in lines]


def _run(args, **kw):
    return CliRunner().invoke(main, ["run", "--model", "tiny-random", "--quiet", *args], **kw)


ARGS = ["--scorer", "streaming", "--baseline", "random", "--budget", "40", "--interval", "8", "--limit", "3",
        "--samples", "2", "--max-new-tokens", "24", "--temperature", "0.7", "--ignore-eos"]


def test_run_writes_config_and_records(tmp_path):
    res = _run([*ARGS, "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(dirs) == 2
    for d in dirs:
        meta = json.loads((d / "config.json").read_text())
        assert d.name.endswith(meta["config_hash"][:10])
        cfg = meta["config"]
        assert cfg["budget"] == 40 and cfg["interval"] == 8 and cfg["accounting"] == "mean"
        assert cfg["nominal_b"] == 40 - 4 - 1
        assert {"torch", "transformers", "retention"} <= set(meta["versions"])
        recs = _records(d)
        assert len(recs) == 6
        assert {(r["problem_id"], r["sample"]) for r in recs} == {(r["problem_id"], r["sample"]) for r in recs[:6]}
        for r in recs:
            assert r["output_tokens"] == len(r["output_token_ids"]) == 24 and r["finish_reason"] == "length"
            assert r["cache_mean_tokens"] <= 40 and not r["budget_exceeded"]
            assert r["kib_per_token"] > 0 and r["prompt_tokens"] > 40
            assert r["verdict"] in (True, False, None) and "extracted" in r
    # paired seeds across arms
    a, b = (_records(d) for d in dirs)
    assert [(r["problem_id"], r["sample"], r["seed"]) for r in a] == [(r["problem_id"], r["sample"], r["seed"]) for r in b]
    # the command's own throughput: the output tokens it generated (2 arms x 6 x 24), then none on resume
    assert re.search(r"^generated 288 output tokens in [0-9.]+ s: [0-9.]+ tok/s$", res.output, re.M), res.output
    assert res.output.count("tok/s per sequence") == 2
    again = _run([*ARGS, "--out", str(tmp_path)])
    assert again.exit_code == 0 and "generated" not in again.output, again.output


def test_resume_after_crash_equals_uninterrupted(tmp_path, monkeypatch):
    full_out, crash_out = tmp_path / "full", tmp_path / "crash"
    assert _run([*ARGS, "--out", str(full_out)]).exit_code == 0

    from retention.runs import runner

    real_append = runner.RecordStore.append
    calls = {"n": 0}

    def dying_append(self, record):
        if calls["n"] == 5:
            raise KeyboardInterrupt  # killed mid-way, after 5 records over both arms
        calls["n"] += 1
        real_append(self, record)

    monkeypatch.setattr(runner.RecordStore, "append", dying_append)
    _run([*ARGS, "--out", str(crash_out)])
    monkeypatch.setattr(runner.RecordStore, "append", real_append)
    dirs = sorted(p for p in crash_out.iterdir() if p.is_dir())
    # a half-written line, as a kill during a write leaves it
    with open(dirs[0] / "records.jsonl", "a") as f:
        f.write('{"problem_id": "test/alg')
    assert sum(len(_records_safe(d)) for d in dirs) == 5

    res = _run([*ARGS, "--out", str(crash_out)])
    assert res.exit_code == 0, res.output
    for d in dirs:
        got = _records(d)
        want = _records(full_out / d.name)
        key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
        assert len(got) == len({key(r) for r in got}) == 6  # nothing duplicated, nothing lost
        assert sorted(got, key=key) == sorted(want, key=key)


def _records_safe(d):
    out = []
    for line in (d / "records.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


@pytest.mark.parametrize("args,msg", [
    (["--model", "no-such-model", "--scorer", "streaming", "--budget", "64"], "known"),
    (["--scorer", "nope", "--budget", "64"], "unknown scorer"),
    (["--scorer", "streaming", "--budget", "0"], "budget"),
    (["--scorer", "streaming", "--budget", "-3"], "budget"),
    (["--scorer", "streaming", "--budget", "64", "--interval", "0"], "interval"),
    (["--scorer", "streaming", "--budget", "64", "--split", "confirm"], "preregister"),
    (["--scorer", "streaming"], "--budget is required"),
    (["--scorer", "streaming", "--budget", "64", "--interval", "200"], "interval"),
])
def test_bad_input_one_line_nonzero(tmp_path, args, msg):
    res = CliRunner().invoke(main, ["run", "--quiet", "--out", str(tmp_path), "--model", "tiny-random", *args])
    assert res.exit_code != 0
    lines = [line for line in res.output.strip().splitlines() if line.startswith("Error")]
    assert len(lines) == 1 and msg.lower() in res.output.lower(), res.output
    assert "Traceback" not in res.output
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_baseline_that_is_also_a_scorer_arm_is_refused(tmp_path):
    res = _run(["--scorer", "streaming", "--baseline", "streaming", "--budget", "40", "--limit", "1",
                "--max-new-tokens", "4", "--out", str(tmp_path / "out")])
    assert res.exit_code == 1 and "--baseline streaming is also a --scorer arm" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_refused_arm_leaves_no_run_directory_behind(tmp_path):
    """Two arms, the second refused when its directory is opened (a changed plugin beside a run of
    its old code): the first arm's directory, created by the same command, is removed again."""
    from click.testing import CliRunner

    from retention.cli import main
    from retention.plugins import _loaded

    plugin = tmp_path / "late.py"
    plugin.write_text("from dataclasses import dataclass\nfrom retention.scorers import Scorer\n\n@dataclass\n"
                      "class Pos(Scorer):\n    name = 'pos'\n    def score(self, view):\n"
                      "        return view.positions[0].float()\n")
    out = tmp_path / "runs"
    common = ["run", "--model", "tiny-random", "--budget", "24", "--limit", "1", "--max-new-tokens", "4",
              "--out", str(out), "--quiet", "--no-grade"]
    assert CliRunner().invoke(main, [*common, "--scorer", f"{plugin}:Pos"]).exit_code == 0
    plugin.write_text(plugin.read_text() + "# changed\n")
    _loaded.clear()
    before = sorted(p.name for p in out.iterdir())
    res = CliRunner().invoke(main, [*common, "--scorer", f"streaming,{plugin}:Pos"])
    assert res.exit_code == 1 and "belongs to another configuration" in res.output
    assert sorted(p.name for p in out.iterdir()) == before  # no streaming directory left behind
