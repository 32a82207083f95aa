"""Run-side inputs of the study at its real shape that once ended in "a bug", were accepted
silently or depended on where a file lies: each is now one `Error:` line with exit 1 and nothing
written, or the arm is named by content."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import invoke as cli


ROOT = Path(__file__).resolve().parents[3]


def assert_one_error(res, match=""):
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1, res.output
    assert [x for x in lines if x.startswith("Error:")] == [lines[-1]] and "Traceback" not in res.output, res.output
    assert match.lower() in lines[-1].lower(), lines[-1]


RUN = ("run", "--model", "tiny-random", "--limit", "1", "--max-new-tokens", "2", "--quiet")


@pytest.mark.parametrize("args,match", [
    (("--scorer", "streaming", "--budget", "99999999999999999999"), "--budget must be <= 16777216"),
    (("--scorer", "streaming", "--budget-bytes", "1e308"), "holds more than 16,777,216 tokens"),
    (("--scorer", "full", "--budget", "16"), "--budget is not used by full"),
    (("--scorer", "full", "--budget-bytes", "64"), "--budget-bytes is not used by full"),
    (("--scorer", "alpha", "--budget", "64", "--radius", "5"), "--radius is a cosine and must be in [-1, 1]"),
    (("--scorer", "alpha", "--budget", "64", "--radius", "-2"), "--radius is a cosine and must be in [-1, 1]"),
    (("--scorer", "alpha", "--budget", "64", "--lambda", "0.5", "--param", "alpha.lam=0.3"),
     "--lambda and --param alpha.lam both set"),
    (("--scorer", "h2o", "--budget", "64", "--param", "h2o.window=4", "--param", "h2o.window=2"),
     "--param h2o.window is given twice"),
])
def test_run_refuses_before_writing_anything(tmp_path, args, match):
    res = cli(*RUN, *args, "--out", tmp_path / "out")
    assert_one_error(res, match)
    assert not (tmp_path / "out").exists()  # no config.json, no .lock left behind


def test_bench_with_statistics_that_are_not_statistics(tmp_path):
    bad = tmp_path / "garbage.safetensors"
    bad.write_text("garbage")
    res = cli("bench", "--model", "tiny-random", "--scorer", "alpha", "--stats", bad, "--max-new-tokens", "2",
              "--problems", "0")
    assert_one_error(res, "is not a retention statistics file")


def test_calibrate_needs_enough_tokens(tmp_path):
    res = cli("calibrate", "--model", "tiny-random", "--tokens", "1", "--out", tmp_path / "s.safetensors")
    assert res.exit_code != 0 and "--tokens" in res.output and "32" in res.output, res.output
    text = tmp_path / "short.txt"
    text.write_text("two words")
    res = cli("calibrate", "--model", "tiny-random", "--text", text, "--out", tmp_path / "s.safetensors")
    assert_one_error(res, "statistics need at least 32")
    assert not (tmp_path / "s.safetensors").exists()


def test_offline_hub_fails_in_one_line_at_once(tmp_path):
    """Nothing answers at the hub endpoint (a closed loopback port): one line, within seconds, not
    a minute of retries."""
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"),
               RETENTION_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("HF_HUB_OFFLINE", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "retention.cli", "calibrate", "--model", "r1-distill-qwen-7b",
                           "--out", str(tmp_path / "s.safetensors")], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot load deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"), lines
    assert "does not answer" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert elapsed < 30, elapsed  # a hang guard (transformers' retries took 46 s), not a speed figure


def test_unreadable_line_message_names_the_file_kind_once(tmp_path):
    from protocol.errors import ProtocolError
    from protocol.io import read_jsonl

    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ProtocolError) as err:
        read_jsonl(path)
    assert "line line" not in str(err.value) and f"{path}:2" in str(err.value) and "unreadable JSON line" in str(err.value)


@pytest.fixture(scope="module")
def tiny_stats(tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "tiny.safetensors"
    res = cli("calibrate", "--model", "tiny-random", "--tokens", "64", "--out", out)
    assert res.exit_code == 0, res.output
    return out


def test_statistics_are_named_by_content_not_by_path(tmp_path, tiny_stats):
    """The same statistics under another cache root: the same configuration, the same run, resumed
    (not regenerated); --lambda is the design card's first-class option (no warning)."""
    other = tmp_path / "elsewhere" / "copy.safetensors"
    other.parent.mkdir()
    shutil.copyfile(tiny_stats, other)
    base = (*RUN, "--scorer", "alpha", "--budget", "64", "--lambda", "0.5", "--temperature", "0")
    first = cli(*base, "--stats", tiny_stats, "--out", tmp_path / "out")
    assert first.exit_code == 0, first.output
    assert "warning" not in first.output.lower() and "deprecated" not in first.output.lower()
    (run_dir,) = [p for p in (tmp_path / "out").iterdir()]
    config = json.loads((run_dir / "config.json").read_text())["config"]
    sha = config["stats_sha256"]
    assert config["scorer_params"]["stats"] == f"sha256:{sha}"
    assert str(tiny_stats) not in (run_dir / "config.json").read_text()
    before = (run_dir / "records.jsonl").read_bytes()
    again = cli(*base, "--stats", other, "--out", tmp_path / "out")
    assert again.exit_code == 0, again.output
    assert [p.name for p in (tmp_path / "out").iterdir()] == [run_dir.name]  # resumed, not a new run
    assert (run_dir / "records.jsonl").read_bytes() == before
