"""Inputs that once ended in a traceback, were accepted silently or damaged files: each is
now one `Error:` line with exit 1 (or, for valid input, a correct result), and nothing is lost."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from retention.cli import main


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res


def assert_one_error(res, match=""):
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1, res.output
    assert [x for x in lines if x.startswith("Error:")] == [lines[-1]] and "Traceback" not in res.output, res.output
    assert match.lower() in lines[-1].lower(), lines[-1]


def test_run_stats_that_is_not_safetensors(tmp_path):
    bad = tmp_path / "stats.safetensors"
    bad.write_text("not safetensors")
    res = cli("run", "--model", "tiny-random", "--scorer", "alpha", "--budget", "64", "--limit", "1",
              "--stats", bad, "--out", tmp_path / "out")
    assert_one_error(res, "not a retention statistics file")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_run_lambda_and_temperature_must_be_finite(tmp_path, value):
    base = ["run", "--model", "tiny-random", "--budget", "64", "--limit", "1", "--out", tmp_path / "o"]
    assert_one_error(cli(*base, "--scorer", "rkv", "--lambda", value), "lambda")
    assert_one_error(cli(*base, "--scorer", "streaming", "--temperature", value), "temperature")


def test_lambda_on_scorers_that_ignore_it_is_refused(tmp_path):
    res = cli("run", "--model", "tiny-random", "--scorer", "streaming,random", "--budget", "64",
              "--lambda", "0.5", "--out", tmp_path / "o")
    assert_one_error(res, "--lambda is not a parameter of any listed scorer")


def test_run_without_limit_on_cpu_says_how_much_it_will_generate(tmp_path, monkeypatch):
    from retention.cli import run_cmd

    def stop(*a, **k):
        raise run_cmd.RetentionError("stopped before generating")

    monkeypatch.setattr(run_cmd, "execute", stop)
    res = cli("run", "--model", "tiny-random", "--scorer", "streaming", "--budget", "64", "--out", tmp_path / "o")
    assert "201 problems x 1 sample(s) x 1 arm(s) x 8,192 tokens = 1,646,592 tokens" in res.output


def _grade_file(tmp_path, rows, raw=None):
    f = tmp_path / "in.jsonl"
    f.write_text(raw if raw is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_grade_lone_surrogates_round_trip_on_stdout_and_out(tmp_path):
    rec = {"pred": "\\boxed{2} \ud800 tail \x00", "gold": "2", "note": "\udfff"}
    f = _grade_file(tmp_path, [rec])
    res = cli("grade", f)
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("{"))
    got = json.loads(line)
    assert got["pred"] == rec["pred"] and got["note"] == rec["note"] and got["verdict"] is True
    out = tmp_path / "graded.jsonl"
    assert cli("grade", f, "--out", out).exit_code == 0
    assert json.loads(out.read_text(encoding="utf-8"))["note"] == "\udfff"


def test_grade_keeps_the_file_mode_of_out(tmp_path):
    f = _grade_file(tmp_path, [{"pred": "\\boxed{2}", "gold": "2"}])
    os.chmod(f, 0o644)
    assert cli("grade", f, "--out", f).exit_code == 0
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o644
    assert json.loads(f.read_text())["verdict"] is True


@pytest.mark.parametrize("raw,match", [
    ('{"pred": "1", "gold": NaN}\n', "NaN"),
    ('{"pred": "1", "problem_id": [1]}\n', "problem_id"),
    ("[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ('{"pred": "1", "gold": "1"}\n\xff\n', "UTF-8"),
])
def test_grade_bad_records(tmp_path, raw, match):
    f = tmp_path / "in.jsonl"
    f.write_bytes(raw.encode("utf-8", "surrogateescape") if "\xff" not in raw else raw.replace("\xff", "").encode() + b"\xff\n")
    assert_one_error(cli("grade", f), match)


def test_stats_field_over_128k_and_invalid_utf8(tmp_path):
    f = tmp_path / "s.csv"
    f.write_text("c,t,b\np1,1,0\np2," + "1" * 200_000 + ",0\n")
    assert_one_error(cli("stats", f, "--treatment", "t", "--baseline", "b", "--cluster", "c"), "unreadable CSV")
    f.write_bytes(b"c,t,b\np1,1,0\n\xff,0,1\n")
    assert_one_error(cli("stats", f, "--treatment", "t", "--baseline", "b", "--cluster", "c"), "UTF-8")


def test_calibrate_out_never_overwrites_its_text(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("some calibration text")
    assert_one_error(cli("calibrate", "--model", "tiny-random", "--text", text, "--out", text), "refusing to overwrite")
    assert text.read_text() == "some calibration text"


def _runs(tmp_path):
    from tests.protocol.test_report import make_run

    a = make_run(tmp_path / "runs", scorer="alpha", n=10, k=1, trace=True)
    b = make_run(tmp_path / "runs", scorer="triattention", n=10, k=1, shift=0.1, seed=1, trace=True)
    return a, b


@pytest.mark.parametrize("damage", ["config", "record", "trace", "record_utf8"])
def test_report_on_malformed_run_files(tmp_path, damage):
    a, _ = _runs(tmp_path)
    if damage == "config":
        (a / "config.json").write_text('{"config": ')
    elif damage == "record_utf8":
        lines = (a / "records.jsonl").read_bytes().splitlines(keepends=True)
        (a / "records.jsonl").write_bytes(lines[0] + b"\xff\xfe\n" + b"".join(lines[1:]))
    else:
        name = "records.jsonl" if damage == "record" else "trace.jsonl"
        lines = (a / name).read_text().splitlines(keepends=True)
        (a / name).write_text(lines[0] + "{garbage\n" + "".join(lines[1:]))
    res = cli("report", tmp_path / "runs", "--boot", "50", "--out", tmp_path / "rep")
    assert_one_error(res)
    assert not (tmp_path / "rep").exists()


def test_confirm_with_a_malformed_ledger_head_is_one_error(tmp_path):
    from protocol import ledger, prereg
    from tests.protocol.test_prereg import FakeRunner, new_plan, run_confirm

    path, _, _ = prereg.write_plan(new_plan(), tmp_path)
    out = tmp_path / "c"
    run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b256"])
    Path(f"{ledger.ledger_path(out)}.head").write_text("{not json")
    with pytest.raises(prereg.ProtocolError, match="not valid JSON"):
        run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b512"])


def test_preregister_refuses_what_run_refuses(tmp_path):
    base = ["preregister", "--out", tmp_path / "plans", "--model", "tiny-random", "-k", "1",
            "--max-new-tokens", "8", "--baseline", '{"scorer": "random"}']
    for treatment, budget, match in [
        ('{"scorer": "streaming", "temperature": -1}', "64", "temperature"),
        ('{"scorer": "streaming", "temperature": "hot"}', "64", "temperature"),
        ('{"scorer": "streaming", "interval": 0}', "64", "interval"),
        ('{"scorer": "streaming"}', "2", "budget"),
        ('{"scorer": "streaming", "accounting": "peak", "interval": 64}', "64", "largest --interval"),
    ]:
        assert_one_error(cli(*base, "--treatment", treatment, "--budget", budget), match)
    assert_one_error(cli(*base, "--treatment", '{"scorer": "streaming"}', "--budget", "64",
                         "--model", "no-such-model"), "unknown model")
    assert_one_error(cli(*base, "--treatment", '{"scorer": "streaming"}', "--budget", "64",
                         "--boot-seed", "-1"), "boot-seed")
    assert not (tmp_path / "plans").exists()
    # with defaults, peak accounting at a small budget registers (the default interval fits)
    res = cli(*base, "--treatment", '{"scorer": "streaming", "accounting": "peak"}', "--budget", "64")
    assert res.exit_code == 0, res.output


def test_tampered_splits_refused_at_registration(tmp_path, monkeypatch):
    import shutil

    from protocol.splits import default_splits_dir

    splits = tmp_path / "splits"
    shutil.copytree(default_splits_dir(), splits)
    dev = next(splits.rglob("dev.txt"))
    dev.write_text(dev.read_text().replace("\n", "\n", 1)[::-1])
    res = cli("preregister", "--out", tmp_path / "plans", "--model", "tiny-random", "-k", "1",
              "--max-new-tokens", "8", "--treatment", '{"scorer": "streaming"}', "--baseline",
              '{"scorer": "random"}', "--budget", "64", "--splits-dir", splits)
    assert_one_error(res, "dev.txt")
    monkeypatch.setenv("RETENTION_SPLITS_DIR", str(splits))  # the environment variable works too
    assert_one_error(cli("splits", "verify"), "dev.txt")
