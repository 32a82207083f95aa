"""Shards merged (or read in place) equal the unsharded run record for record; merge refuses every
inconsistency with one line, writing nothing."""

import json
import shutil

import pytest

from protocol.report import load_run
from tests.cli import invoke as _cli, ok as _ok

VOLATILE = {"wall_seconds", "tokens_per_second"}
ARGS = ["run", "--model", "tiny-random", "--quiet", "--scorer", "streaming", "--baseline", "random", "--budget", "40",
        "--interval", "8", "--limit", "3", "--samples", "2", "--max-new-tokens", "12", "--temperature", "0.7",
        "--ignore-eos"]


def _stable(path):
    return [{k: v for k, v in json.loads(line).items() if k not in VOLATILE}
            for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    _ok(*ARGS, "--out", root / "full")
    for i in range(3):
        _ok(*ARGS, "--out", root / f"s{i}", "--shard", f"{i}/3")
    return root


def _run_names(root):
    return sorted(p.name for p in (root / "full").iterdir())


def test_merged_shards_equal_unsharded_record_for_record(runs, tmp_path):
    res = _ok("merge", runs / "s0", runs / "s1", runs / "s2", "--out", tmp_path / "m")
    assert res.output.count("6 records merged") == 2
    for name in _run_names(runs):
        want, got = runs / "full" / name, tmp_path / "m" / name
        assert _stable(got / "records.jsonl") == _stable(want / "records.jsonl")
        assert (got / "trace.jsonl").read_text() == (want / "trace.jsonl").read_text()
        meta, want_meta = (json.loads((d / "config.json").read_text()) for d in (got, want))
        assert meta["config_hash"] == want_meta["config_hash"] and meta["config"] == want_meta["config"]
        assert meta["merged"]["shards"] == 3 and "mod N" in meta["merged"]["rule"]
    # each shard did only its part
    for i in range(3):
        for name in _run_names(runs):
            assert len(_stable(runs / f"s{i}" / name / f"records.shard-{i}-of-3.jsonl")) == 2


def test_shards_in_one_directory_are_read_by_report_and_consolidated_by_run(runs, tmp_path):
    shared = tmp_path / "shared"
    for i in range(3):
        for name in _run_names(runs):
            shutil.copytree(runs / f"s{i}" / name, shared / name, dirs_exist_ok=True)
    name = _run_names(runs)[0]
    assert {(r["problem_id"], r["sample"]) for r in load_run(shared / name).records} == \
        {(r["problem_id"], r["sample"]) for r in _stable(runs / "full" / name / "records.jsonl")}
    rep = _ok("report", shared, "--out", tmp_path / "rep", "--boot", 200)
    assert "streaming" in rep.output
    # an unsharded run over the sharded directory adopts the shards and generates nothing new
    res = _ok(*ARGS, "--out", shared)
    for name in _run_names(runs):
        assert _stable(shared / name / "records.jsonl") == _stable(runs / "full" / name / "records.jsonl")
        assert sorted(p.name for p in (shared / name / "shards").iterdir())[0] == "records.shard-0-of-3.jsonl"
    assert res.output.count("6 records") == 2


def test_incomplete_shards_refuse_unsharded_run(runs, tmp_path):
    shared = tmp_path / "shared"
    for i in (0, 2):
        shutil.copytree(runs / f"s{i}", shared, dirs_exist_ok=True)
    res = _cli(*ARGS, "--out", shared)
    assert res.exit_code != 0 and "missing shard(s) 1/3" in res.output and "--shard" in res.output
    load = load_run(shared / _run_names(runs)[0])
    assert any("shard 1/3 has no records" in w for w in load.warnings)


def _copy(runs, tmp_path, which=(0, 1, 2)):
    dirs = []
    for i in which:
        d = tmp_path / f"in{i}"
        shutil.copytree(runs / f"s{i}", d)
        dirs.append(d)
    return dirs


def _edit_lines(path, fn):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(fn(lines)))


def _refused(dirs, out, needle):
    res = _cli("merge", *dirs, "--out", out)
    assert res.exit_code != 0, res.output
    assert res.output.startswith("Error: ") and res.output.strip().count("\n") == 0, res.output
    assert needle in res.output, res.output
    assert not out.exists()


def test_refuses_mismatched_configuration(runs, tmp_path):
    d0, _d1, d2 = _copy(runs, tmp_path)
    other = tmp_path / "other"
    _ok(*[a if a != "12" else "13" for a in ARGS], "--out", other, "--shard", "1/3")
    _refused([d0, other, d2], tmp_path / "m", "configuration mismatch")
    _refused([d0, other, d2], tmp_path / "m", "max_new_tokens")


def test_refuses_duplicated_pair(runs, tmp_path):
    dirs = _copy(runs, tmp_path)
    for f in dirs[1].glob("*/records.shard-1-of-3.jsonl"):
        _edit_lines(f, lambda lines: lines + lines[:1])
    _refused(dirs, tmp_path / "m", "duplicated pair")


def test_refuses_missing_pair(runs, tmp_path):
    dirs = _copy(runs, tmp_path)
    for f in dirs[2].glob("*/records.shard-2-of-3.jsonl"):
        _edit_lines(f, lambda lines: lines[:-1])
    _refused(dirs, tmp_path / "m", "1 pair(s) missing")


def test_refuses_pair_of_another_shard(runs, tmp_path):
    dirs = _copy(runs, tmp_path)
    name = _run_names(runs)[0]
    line = (dirs[0] / name / "records.shard-0-of-3.jsonl").read_text().splitlines(keepends=True)[0]
    _edit_lines(dirs[0] / name / "records.shard-0-of-3.jsonl", lambda lines: lines[1:])  # moved, not copied
    _edit_lines(dirs[1] / name / "records.shard-1-of-3.jsonl", lambda lines: [line] + lines)
    _refused(dirs, tmp_path / "m", "belongs to shard 0/3")


def test_refuses_missing_and_repeated_shards(runs, tmp_path):
    d0, d1, d2 = _copy(runs, tmp_path)
    _refused([d0, d2], tmp_path / "m", "missing shard(s) 1/3")
    again = tmp_path / "again"
    shutil.copytree(d1, again)
    _refused([d0, d1, again, d2], tmp_path / "m", "given twice")


@pytest.mark.parametrize("key,needle", [("code_version", "different code versions"),
                                        ("split_manifest_sha256", "different split manifests")])
def test_refuses_other_code_version_or_manifest(runs, tmp_path, key, needle):
    dirs = _copy(runs, tmp_path)
    for side in dirs[1].glob("*/shard-1-of-3.json"):
        info = json.loads(side.read_text())
        info[key] = "something-else"
        side.write_text(json.dumps(info))
    _refused(dirs, tmp_path / "m", needle)


def test_refuses_existing_output_and_unsharded_input(runs, tmp_path):
    dirs = _copy(runs, tmp_path)
    _ok("merge", *dirs, "--out", tmp_path / "m")
    res = _cli("merge", *dirs, "--out", tmp_path / "m")
    assert res.exit_code != 0 and "already exists" in res.output
    _refused([runs / "full"], tmp_path / "m2", "not shards")


def test_confirm_in_shards_equals_unsharded_confirm(tmp_path, monkeypatch):
    arm = {"interval": 8, "temperature": 0.7, "limit": 2}

    def register(name):
        # A cell is confirmed once per registry: the two confirmations compared here each get one.
        monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path / f"state-{name}"))
        _ok("preregister", "--out", tmp_path / f"plans-{name}", "--model", "tiny-random", "--budget", 40,
            "--treatment", json.dumps(dict(arm, scorer="streaming")), "--baseline", json.dumps(dict(arm, scorer="random")),
            "-k", 2, "--max-new-tokens", 8, "--boot", 500, "--boot-max", 500)
        (plan,) = (tmp_path / f"plans-{name}").glob("plan-*.json")
        return plan

    plan = register("whole")
    _ok("confirm", "--plan", plan, "--out", tmp_path / "whole")
    plan = register("sharded")
    sharded = tmp_path / "sharded"
    _ok("confirm", "--plan", plan, "--out", sharded, "--shard", "1/2")
    assert not (sharded / "ledger.jsonl").exists()  # a shard is not a result
    early = _cli("confirm", "--plan", plan, "--out", sharded)
    assert early.exit_code != 0 and "missing shard(s) 0/2" in early.output
    _ok("confirm", "--plan", plan, "--out", sharded, "--shard", "0/2")
    _ok("confirm", "--plan", plan, "--out", sharded)
    entries = [json.loads(line) for line in (sharded / "ledger.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (tmp_path / "whole" / "ledger.jsonl").read_text().splitlines()]
    (got_cell,), (want_cell,) = ([e for e in es if e.get("kind") == "cell"] for es in (entries, want))
    assert got_cell["result"] == want_cell["result"]
    for arm_name, info in got_cell["runs"].items():
        run_dir = sharded / info["path"]
        assert _stable(run_dir / "records.jsonl") == _stable(tmp_path / "whole" / want_cell["runs"][arm_name]["path"]
                                                             / "records.jsonl")
