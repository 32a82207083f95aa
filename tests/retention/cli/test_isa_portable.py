"""The ISA-independent mode (`run --isa-portable`): float32 with the kernel libraries held to AVX2
gives the records the host's own instruction set gives (two ISA settings, one host, two processes:
the variables are read when the libraries load), and the records say which host and which setting
made them (docs/reproducibility.md). The records' comparison needs two processes (tests/conftest.py
puts it in the slow tier); the refusals happen before anything loads, so they run in this one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.host import PORTABLE_ENV, host_differences, portable_problem

ROOT = Path(__file__).resolve().parents[3]
ARGS = ["--model", "tiny-random", "--quiet", "--scorer", "streaming", "--budget", "40", "--interval", "8",
        "--limit", "3", "--samples", "2", "--max-new-tokens", "40", "--temperature", "0.7", "--batch-size", "3"]


def _run(out: Path, *extra, pinned: bool):
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if pinned:
        env.update(PORTABLE_ENV)
    return subprocess.run([sys.executable, "-m", "retention.cli", "run", *ARGS, *extra, "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _invoke(out: Path, *extra):
    """`retention run` in this process, under the environment the test has set."""
    return CliRunner().invoke(main, ["run", *ARGS, *extra, "--out", str(out)])


def _records(out: Path) -> list[dict]:
    (path,) = out.glob("*/records.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_portable_records_are_those_of_the_native_instruction_set(tmp_path):
    native = _run(tmp_path / "native", "--dtype", "float32", pinned=False)
    assert native.returncode == 0, native.stderr
    pinned = _run(tmp_path / "pinned", "--dtype", "float32", "--isa-portable", pinned=True)
    assert pinned.returncode == 0, pinned.stderr
    a, b = _records(tmp_path / "native"), _records(tmp_path / "pinned")
    assert len(a) == len(b) == 6
    assert [r["output_token_ids"] for r in a] == [r["output_token_ids"] for r in b]
    assert [r["verdict"] for r in a] == [r["verdict"] for r in b]
    assert b[0]["host"]["env"] == PORTABLE_ENV and a[0]["host"]["env"] == {}
    assert b[0]["host"]["capability"] == "AVX2"
    if a[0]["host"]["capability"] != "AVX2":  # a host with more than AVX2: the two settings differ
        assert "capability" in host_differences(a[0]["host"], b[0]["host"])


def test_the_portable_mode_refuses_what_it_cannot_pin(tmp_path, monkeypatch):
    for k in PORTABLE_ENV:
        monkeypatch.delenv(k, raising=False)
    assert "needs --dtype float32" in portable_problem("bfloat16")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in portable_problem("float32")
    for k, v in PORTABLE_ENV.items():
        monkeypatch.setenv(k, v)
    assert portable_problem("float32") is None
    res = _invoke(tmp_path / "bf16", "--dtype", "bfloat16", "--isa-portable")
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    assert res.stderr.strip().splitlines()[-1] == ("Error: --isa-portable needs --dtype float32 (bfloat16 kernels "
                                                    "differ by instruction set), got bfloat16")
    for k in PORTABLE_ENV:
        monkeypatch.delenv(k)
    res = _invoke(tmp_path / "unpinned", "--dtype", "float32", "--isa-portable")
    assert res.exit_code != 0 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2,STRICT" in res.stderr
    assert not (tmp_path / "bf16").exists() and not (tmp_path / "unpinned").exists()


@pytest.mark.parametrize("recorded,differs", [(None, ["host"]), ({"isa": ["avx2"]}, "isa")])
def test_host_differences(recorded, differs):
    from retention.host import host_fingerprint

    got = host_differences(recorded, host_fingerprint())
    assert got == differs if isinstance(differs, list) else differs in got
