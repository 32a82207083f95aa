"""`--trace` through the command line: trace lines gain the cache trace and records their prompt
summary, the configuration hash (so the run directory) is the one of an untraced run, a record's
trace recounts its `cache_mean_tokens` and `compactions`, resume and merge keep a directory all
traced or all untraced, and `confirm --trace` traces its runs."""

from __future__ import annotations

import json
import shutil

from tests.retention.runtime.test_trace import recount
from tests.cli import invoke as _cli, ok as _ok

VOLATILE = {"wall_seconds", "tokens_per_second"}
ARGS = ["run", "--model", "tiny-random", "--quiet", "--scorer", "h2o", "--baseline", "random", "--budget", "40",
        "--interval", "8", "--limit", "2", "--samples", "2", "--max-new-tokens", "20", "--temperature", "0.7",
        "--ignore-eos", "--batch-size", "3"]


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _dirs(out):
    return sorted(p for p in out.iterdir() if p.is_dir())


def test_trace_writes_cache_lines_with_the_same_hash(tmp_path):
    _ok(*ARGS, "--out", tmp_path / "plain")
    _ok(*ARGS, "--out", tmp_path / "traced", "--trace", "--fidelity")
    _ok(*ARGS, "--out", tmp_path / "plain-fid", "--fidelity")
    plain, traced = _dirs(tmp_path / "plain-fid"), _dirs(tmp_path / "traced")
    assert [d.name for d in plain] == [d.name for d in traced]  # the run id ends with the configuration hash
    for p, t in zip(plain, traced):
        pm, tm = (json.loads((d / "config.json").read_text()) for d in (p, t))
        assert pm["config_hash"] == tm["config_hash"] and pm["config"] == tm["config"]
        assert (pm["trace"], tm["trace"]) == (False, True)
        assert all("cache" not in line for line in _lines(p / "trace.jsonl"))
        precs, trecs = _lines(p / "records.jsonl"), _lines(t / "records.jsonl")
        lines = {(x["problem_id"], x["sample"]): x for x in _lines(t / "trace.jsonl")}
        assert len(precs) == len(trecs) == len(lines) == 4
        for pr, tr in zip(precs, trecs):
            assert "prompt_evicted_step" not in pr and "prompt_held_final" not in pr
            extra = {"prompt_evicted_step", "prompt_held_final"}
            assert {k: v for k, v in tr.items() if k not in VOLATILE | extra} == \
                   {k: v for k, v in pr.items() if k not in VOLATILE}  # tracing changes nothing else
            cache = lines[(tr["problem_id"], tr["sample"])]["cache"]
            mean, compactions, _ = recount(cache)
            assert mean == tr["cache_mean_tokens"] and compactions == tr["compactions"] > 0
            assert cache["prompt_tokens"] == tr["prompt_tokens"] and len(cache["kl"]) == tr["fidelity"]["steps"]
            assert tr["prompt_evicted_step"] == 0 and 0 < tr["prompt_held_final"] < 1  # prompt > budget
    # without --fidelity the untraced records are those of an untraced run with fidelity off
    assert [d.name for d in _dirs(tmp_path / "plain")] != [d.name for d in plain]  # fidelity is configuration


def test_resume_with_another_trace_setting_is_refused(tmp_path):
    _ok(*ARGS, "--out", tmp_path, "--trace")
    for d in _dirs(tmp_path):  # as a run killed after two records per arm leaves it
        kept = (d / "records.jsonl").read_text().splitlines()[:2]
        (d / "records.jsonl").write_text("".join(line + "\n" for line in kept))
    res = _cli(*ARGS, "--out", tmp_path)
    assert res.exit_code == 1 and "written with --trace; resume it with --trace" in res.output
    assert res.output.count("\n") == 1
    assert all(len(_lines(d / "records.jsonl")) == 2 for d in _dirs(tmp_path))  # nothing written is lost
    _ok(*ARGS, "--out", tmp_path, "--trace")  # the same setting resumes (2 more records per arm)
    for d in _dirs(tmp_path):
        assert len(_lines(d / "records.jsonl")) == 4
        assert all("cache" in line for line in _lines(d / "trace.jsonl"))
    untraced = tmp_path / "u"
    _ok(*ARGS, "--out", untraced, "--limit", "1")
    res = _cli(*ARGS, "--out", untraced, "--trace", "--limit", "1")
    assert res.exit_code == 1 and "written without --trace" in res.output


def test_an_empty_run_directory_takes_the_new_setting(tmp_path):
    _ok(*ARGS, "--out", tmp_path, "--limit", "1")
    for d in _dirs(tmp_path):
        (d / "records.jsonl").write_text("")
        (d / "trace.jsonl").write_text("")
    _ok(*ARGS, "--out", tmp_path, "--trace", "--limit", "1")
    for d in _dirs(tmp_path):
        assert json.loads((d / "config.json").read_text())["trace"] is True
        assert all("cache" in line for line in _lines(d / "trace.jsonl"))


def test_merged_traced_shards_carry_their_traces(tmp_path):
    _ok(*ARGS, "--out", tmp_path / "whole", "--trace")
    for i in range(2):
        _ok(*ARGS, "--out", tmp_path / f"s{i}", "--shard", f"{i}/2", "--trace")
    _ok("merge", tmp_path / "s0", tmp_path / "s1", "--out", tmp_path / "m")
    for d in _dirs(tmp_path / "whole"):
        got = tmp_path / "m" / d.name
        assert json.loads((got / "config.json").read_text())["trace"] is True
        want = {(x["problem_id"], x["sample"]): x["cache"] for x in _lines(d / "trace.jsonl")}
        assert {(x["problem_id"], x["sample"]): x["cache"] for x in _lines(got / "trace.jsonl")} == want
    # a shard of the same run without --trace is refused by the merge
    shutil.rmtree(tmp_path / "s1")
    _ok(*ARGS, "--out", tmp_path / "s1", "--shard", "1/2")
    res = _cli("merge", tmp_path / "s0", tmp_path / "s1", "--out", tmp_path / "m2")
    assert res.exit_code == 1 and "different --trace settings" in res.output
    assert not (tmp_path / "m2").exists()
    # a traced shard that lost its trace lines is refused too
    shutil.rmtree(tmp_path / "s1")
    _ok(*ARGS, "--out", tmp_path / "s1", "--shard", "1/2", "--trace")
    for f in (tmp_path / "s1").glob("*/trace.shard-1-of-2.jsonl"):
        f.write_text("")
    res = _cli("merge", tmp_path / "s0", tmp_path / "s1", "--out", tmp_path / "m3")
    assert res.exit_code == 1 and "have no trace line" in res.output


def test_trace_needs_this_projects_engine(tmp_path):
    res = _cli("run", "--model", "tiny-random", "--quiet", "--scorer", "full", "--limit", "1", "--max-new-tokens", "4",
               "--engine", "vllm", "--trace", "--out", tmp_path)
    assert res.exit_code == 1 and "--trace records this project's cache and needs --engine hf" in res.output


def test_confirm_trace_traces_its_runs(tmp_path):
    arm = {"interval": 8, "temperature": 0.7, "limit": 2}
    _ok("preregister", "--out", tmp_path / "plans", "--model", "tiny-random", "--budget", 40,
        "--treatment", json.dumps(dict(arm, scorer="streaming")), "--baseline", json.dumps(dict(arm, scorer="random")),
        "-k", 2, "--max-new-tokens", 8, "--boot", 500, "--boot-max", 500)
    (plan,) = (tmp_path / "plans").glob("plan-*.json")
    res = _cli("confirm", "--plan", plan, "--out", tmp_path / "c", "--trace", "--runner",
               "tests.protocol.test_prereg:cli_runner")
    assert res.exit_code == 1 and "--trace needs the built-in runner" in res.output
    _ok("confirm", "--plan", plan, "--out", tmp_path / "c", "--trace")
    runs = [p.parent for p in (tmp_path / "c").rglob("records.jsonl")]
    assert len(runs) == 2
    for d in runs:
        recs = {(r["problem_id"], r["sample"]): r for r in _lines(d / "records.jsonl")}
        for line in _lines(d / "trace.jsonl"):
            rec = recs[(line["problem_id"], line["sample"])]
            assert recount(line["cache"])[:2] == (rec["cache_mean_tokens"], rec["compactions"])
