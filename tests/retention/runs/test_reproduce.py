"""`retention reproduce`: records decoded again from config.json, compared token by token."""

import json

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.runs.reproduce import first_difference, token_digest

ARGS = ["--model", "tiny-random", "--quiet", "--scorer", "streaming", "--budget", "40", "--interval", "8",
        "--limit", "2", "--samples", "2", "--max-new-tokens", "16", "--temperature", "0.7", "--batch-size", "3"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    res = CliRunner().invoke(main, ["run", *ARGS, "--out", str(out)])
    assert res.exit_code == 0, res.output
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    return d


def _reproduce(path, *extra):
    return CliRunner().invoke(main, ["reproduce", str(path), *extra])


def test_identical_records_exit_zero(run_dir):
    before = (run_dir / "records.jsonl").read_bytes()
    res = _reproduce(run_dir, "--limit", "3")
    assert res.exit_code == 0, res.output + res.stderr
    lines = res.output.splitlines()
    recs = [json.loads(line) for line in before.decode().splitlines()][:3]
    for rec in recs:
        want = (f"{rec['problem_id']} sample {rec['sample']}: identical ({len(rec['output_token_ids'])} tokens, "
                f"sha256 {token_digest(rec['output_token_ids'])[:16]})")
        assert want in lines
    assert lines[-1] == "3 of 3 record(s) identical"
    assert "(same)" in res.output and "model revision random-seed-0" in res.output
    assert (run_dir / "records.jsonl").read_bytes() == before  # nothing written into the run


def test_a_changed_token_is_named_and_exits_one(run_dir, tmp_path):
    copy = tmp_path / run_dir.name
    copy.mkdir()
    (copy / "config.json").write_bytes((run_dir / "config.json").read_bytes())
    recs = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    original = recs[1]["output_token_ids"][5]
    recs[1]["output_token_ids"][5] = original + 1
    (copy / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = _reproduce(copy, "--limit", "2")
    assert res.exit_code == 1
    lines = res.output.splitlines()
    assert lines[-2].startswith(f"{recs[1]['problem_id']} sample {recs[1]['sample']}: differs at token 5: "
                                f"recorded {original + 1}, reproduced {original} ")
    assert lines[-1] == "1 of 2 record(s) identical"


def test_a_configuration_that_does_not_match_its_hash_is_refused(run_dir, tmp_path):
    copy = tmp_path / run_dir.name
    copy.mkdir()
    meta = json.loads((run_dir / "config.json").read_text())
    meta["config"]["seed"] = 1  # edited after the run: its records are not this configuration's
    (copy / "config.json").write_text(json.dumps(meta))
    (copy / "records.jsonl").write_bytes((run_dir / "records.jsonl").read_bytes())
    res = _reproduce(copy)
    assert res.exit_code == 1
    assert res.stderr.strip().startswith("Error: ") and len(res.stderr.strip().splitlines()) == 1
    assert "does not hash to its config_hash" in res.stderr


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference([], []) is None


def test_a_bfloat16_full_cache_run_reproduces_from_any_records(tmp_path, monkeypatch):
    """In bfloat16 a record depends on its slot count and on the rows' size (the run's longest
    prompt, for `full`): a record reproduced alone is decoded at both, token for token."""
    from retention.runs import reproduce

    out = tmp_path / "runs"
    args = ["--model", "tiny-random", "--dtype", "bfloat16", "--quiet", "--scorer", "full", "--limit", "4",
            "--max-new-tokens", "48", "--temperature", "0", "--batch-size", "3", "--ignore-eos"]
    assert CliRunner().invoke(main, ["run", *args, "--out", str(out)]).exit_code == 0
    (d,) = [p for p in out.iterdir() if p.is_dir()]
    path = d / "records.jsonl"  # the record of the shortest prompt first: alone it would size rows smaller
    records = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["prompt_tokens"])
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    seen, real = [], reproduce.run_engine
    monkeypatch.setattr(reproduce, "run_engine", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    res = _reproduce(d, "--limit", "1")
    assert res.exit_code == 0 and res.output.splitlines()[-1] == "1 of 1 record(s) identical", res.output
    assert [(kw["batch_size"], kw["max_prompt"]) for kw in seen] == [(3, records[-1]["prompt_tokens"])]
    assert records[0]["prompt_tokens"] < records[-1]["prompt_tokens"]


def _copy_run(run_dir, tmp_path, edit):
    """A copy of the run whose records went through `edit(list_of_records)`."""
    copy = tmp_path / run_dir.name
    copy.mkdir()
    (copy / "config.json").write_bytes((run_dir / "config.json").read_bytes())
    recs = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    edit(recs)
    (copy / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return copy, recs


def test_an_edited_verdict_and_meter_are_named_though_the_tokens_match(run_dir, tmp_path):
    was = {}

    def edit(recs):
        was["verdict"] = recs[0]["verdict"]
        assert was["verdict"] is not True  # a tiny random model answers nothing right
        recs[0]["verdict"] = True  # a verdict of a dev run set to true ...
        recs[1]["compactions"] += 1  # ... or a meter figure changed after the run

    copy, recs = _copy_run(run_dir, tmp_path, edit)
    res = _reproduce(copy, "--limit", "2")
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    head0 = f"{recs[0]['problem_id']} sample {recs[0]['sample']}: same tokens"
    (line0,) = [ln for ln in lines if ln.startswith(head0)]
    assert f"verdict recorded True, reproduced {was['verdict']!r}" in line0
    head1 = f"{recs[1]['problem_id']} sample {recs[1]['sample']}: same tokens"
    (line1,) = [ln for ln in lines if ln.startswith(head1)]
    assert f"compactions recorded {recs[1]['compactions']}, reproduced {recs[1]['compactions'] - 1}" in line1
    assert lines[-1] == "0 of 2 record(s) identical"
    assert not any(ln.startswith("grader:") for ln in lines)  # graded by this grader: an edit, not a rule change

    def older(recs):
        edit(recs)
        for r in recs:
            r["grader_version"] = "0123456789abcdef"

    other = tmp_path / "older"
    other.mkdir()
    copy2, _ = _copy_run(run_dir, other, older)
    res = _reproduce(copy2, "--limit", "2")
    assert "grader: records graded by 0123456789abcdef, now " in res.output


def test_records_carry_the_host_and_another_host_is_compared_by_answers(run_dir, tmp_path):
    from retention.host import ISA_FLAGS, host_fingerprint

    recs = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    meta = json.loads((run_dir / "config.json").read_text())
    here = host_fingerprint()
    assert all(r["host"] == here for r in recs) and meta["host"] == here
    assert set(here["isa"]) <= set(ISA_FLAGS) and here["torch"] and here["threads"] >= 1

    def edit(recs):
        for r in recs:  # made on a CPU without AVX512/AMX: bf16 kernels differ there
            r["host"] = dict(r["host"], isa=["avx2"], cpu="Another CPU")
        recs[1]["output_token_ids"][3] += 1  # its tokens differ; its answer does not

    copy, recs = _copy_run(run_dir, tmp_path, edit)
    res = _reproduce(copy, "--limit", "2")
    assert res.exit_code == 0, res.output
    assert "host: DIFFERENT (isa differ); the tokens cannot be expected to match: compared at the level of " \
           "answers" in res.output
    assert f"{recs[1]['problem_id']} sample {recs[1]['sample']}: differs at token 3" in res.output
    assert res.output.splitlines()[-1] == ("2 of 2 record(s) give the same answers (tokens not compared: "
                                           "another host)")

    def edit_verdict(recs):
        edit(recs)
        recs[0]["verdict"] = True

    other = tmp_path / "other"
    other.mkdir()
    copy2, _ = _copy_run(run_dir, other, edit_verdict)
    res = _reproduce(copy2, "--limit", "2")
    assert res.exit_code == 1 and res.output.splitlines()[-1].startswith("1 of 2 record(s) give the same answers")
