"""`retention run --batch-size`: a batched run killed mid-way resumes with no record lost or
duplicated, and its records equal those of a run at batch size 1 (sampling included)."""

import json

from click.testing import CliRunner

from retention.cli import main

VOLATILE = {"wall_seconds", "tokens_per_second", "batch_size"}
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
