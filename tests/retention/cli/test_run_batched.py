"""`retention run --batch-size`: a batched run killed mid-way resumes with no record lost or
duplicated, and its records equal those of a run at batch size 1 (sampling included)."""

import json

from click.testing import CliRunner

from retention.cli import main

VOLATILE = {"wall_seconds", "tokens_per_second", "batch_size", "slots"}
ARGS = ["--model", "tiny-random", "--quiet", "--scorer", "h2o", "--baseline", "streaming", "--budget", "24",
        "--interval", "4", "--limit", "3", "--samples", "2", "--max-new-tokens", "16", "--temperature", "0.7"]


def _records(run_dir):
    out = []
    path = run_dir / "records.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            out.append({k: v for k, v in json.loads(line).items() if k not in VOLATILE})
        except json.JSONDecodeError:
            pass
    return out


def _key(r):
    return r["problem_id"], r["sample"]


def test_batched_resume_equals_batch_one(tmp_path, monkeypatch):
    one, crash = tmp_path / "one", tmp_path / "crash"
    res = CliRunner().invoke(main, ["run", *ARGS, "--batch-size", "1", "--out", str(one)])
    assert res.exit_code == 0, res.output

    from retention.runs import runner

    real_append = runner.RecordStore.append
    calls = {"n": 0}

    def dying_append(self, record):
        if calls["n"] == 4:
            raise KeyboardInterrupt  # killed with sequences in flight
        calls["n"] += 1
        assert record["batch_size"] == 4
        real_append(self, record)

    monkeypatch.setattr(runner.RecordStore, "append", dying_append)
    CliRunner().invoke(main, ["run", *ARGS, "--batch-size", "4", "--out", str(crash)])
    monkeypatch.setattr(runner.RecordStore, "append", real_append)
    dirs = sorted(p for p in crash.iterdir() if p.is_dir())
    assert len(dirs) == 2 and sum(len(_records(d)) for d in dirs) == 4

    res = CliRunner().invoke(main, ["run", *ARGS, "--batch-size", "4", "--out", str(crash)])
    assert res.exit_code == 0, res.output
    for d in dirs:
        got, want = _records(d), _records(one / d.name)  # the batch size is not in the run id
        assert len(got) == len({_key(r) for r in got}) == 6
        assert sorted(got, key=_key) == sorted(want, key=_key)


def test_resume_keeps_the_recorded_slot_count(tmp_path, monkeypatch):
    """The slot count is in the run directory and every record; a resume at another explicit
    --batch-size is refused in one line naming both (nothing written is lost), and a resume without
    --batch-size decodes at the recorded count."""
    from retention.runs import runner

    out = tmp_path / "runs"
    real_append = runner.RecordStore.append
    calls = {"n": 0}

    def dying_append(self, record):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        real_append(self, record)

    monkeypatch.setattr(runner.RecordStore, "append", dying_append)
    CliRunner().invoke(main, ["run", *ARGS, "--batch-size", "4", "--out", str(out)])
    monkeypatch.setattr(runner.RecordStore, "append", real_append)
    dirs = sorted(p for p in out.iterdir() if p.is_dir())
    assert [json.loads((d / "config.json").read_text())["slots"] for d in dirs] == [4, 4]
    before = {d: _records(d) for d in dirs}
    assert sum(map(len, before.values())) == 2

    res = CliRunner().invoke(main, ["run", *ARGS, "--batch-size", "2", "--out", str(out)])
    assert res.exit_code != 0
    line = res.output.strip().splitlines()[-1]
    assert "decoded at 4 slots" in line and "--batch-size 2 asks for 2" in line
    assert {d: _records(d) for d in dirs} == before

    res = CliRunner().invoke(main, ["run", *ARGS, "--out", str(out)])  # automatic: the recorded 4
    assert res.exit_code == 0, res.output
    assert "resuming at its recorded 4 slots" in res.output
    for d in dirs:
        lines = [json.loads(x) for x in (d / "records.jsonl").read_text().splitlines()]
        assert len(lines) == 6 and {r["slots"] for r in lines} == {4}
