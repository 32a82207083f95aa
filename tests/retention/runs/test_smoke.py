"""A plan that registers can run, and a broken plugin is refused before a record or a cell (issue 46):
`preregister` types parameters and builds every arm as `confirm` will, asks the engine, runs a plugin's
cheap checks; `run` refuses a broken plugin at its first compaction before writing a record."""

from __future__ import annotations

import sys
from pathlib import Path

from protocol import prereg
from tests.retention.runs.test_identity import _cli, _keys, _preregister

BROKEN = Path(__file__).parents[1] / "data" / "broken_mechanisms.py"


def _one_line(res) -> str:
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1, res.output
    return lines[0]


def test_an_integral_float_is_registered_as_the_integer_it_runs_as(tmp_path):
    res = _cli(["preregister", "--out", str(tmp_path / "a"), "--model", "tiny-random", "--budget", "256",
                "--treatment", '{"scorer": "rkv", "state": {"name": "quant", "params": {"bits": 8.0, "group": 16.0}}}',
                "--baseline-set", "scorer=streaming", "-k", "1", "--max-new-tokens", "16",
                "--code-version", "0.1.0+gtest", "--runner", "tests.protocol.test_prereg:cli_runner"])
    assert res.exit_code == 0, res.output
    (path,) = (tmp_path / "a").glob("plan-*.json")
    plan, _ = prereg.load_plan(path)
    assert plan["treatment"]["state"]["params"]["bits"] == 8 and isinstance(plan["treatment"]["state"]["params"]["bits"], int)
    res = _cli(["preregister", "--out", str(tmp_path / "b"), "--model", "tiny-random", "--budget", "256",
                "--treatment", '{"scorer": "rkv", "state": {"name": "quant", "params": {"bits": 8.5}}}',
                "--baseline-set", "scorer=streaming", "-k", "1", "--max-new-tokens", "16",
                "--code-version", "0.1.0+gtest", "--runner", "tests.protocol.test_prereg:cli_runner"])
    assert "quant.bits is an integer parameter, got 8.5" in _one_line(res)


def test_negative_zero_registers_the_same_cell(tmp_path):
    keys = []
    for name, value in (("a", "0.0"), ("b", "-0.0")):
        res = _preregister(tmp_path / name, treatment=("scorer=rkv", "state.name=merge", f"state.params.threshold={value}"))
        assert res.exit_code == 0, res.output
        keys.append(_keys(tmp_path / name)[0])
    assert keys[0] == keys[1]


def test_an_engine_that_cannot_run_a_mechanism_refuses_the_arm(tmp_path):
    res = _preregister(tmp_path, treatment=("scorer=full", "decoding=loop-guard", "engine=vllm"))
    line = _one_line(res)
    assert "--engine vllm cannot run --decoding loop-guard" in line
    assert not list(tmp_path.glob("plan-*.json"))


def test_preregister_refuses_a_plugin_failing_its_cheap_checks(tmp_path):
    res = _preregister(tmp_path, treatment=("scorer=rkv", f"state={BROKEN}:ClaimsInt4"))
    line = _one_line(res)
    assert "ClaimsInt4" in line and "buffers need at least" in line
    assert not list(tmp_path.glob("plan-*.json"))


def test_run_refuses_a_broken_plugin_before_writing_a_record(tmp_path):
    out = tmp_path / "runs"
    res = _cli(["run", "--model", "tiny-random", "--scorer", "snapkv", "--budget", "24", "--interval", "4",
                "--decoding", f"{BROKEN}:OneColumnShort", "--limit", "2", "--max-new-tokens", "40", "--out", str(out),
                "--quiet", "--no-grade", "--batch-size", "2"])
    line = _one_line(res)
    assert "one-column-short" in line and "returned logits (1, 258)" in line
    records = list(out.rglob("records.jsonl"))
    assert all(not p.read_text().strip() for p in records)


LAZY = '''from retention.policy.registry import get_scorer_class

Base = get_scorer_class("snapkv")


class Lazy(Base):
    name = "lazy"

    def score(self, view):
        import lazyhelper46  # imported while decoding: in no identity taken before the run
        return super().score(view) * lazyhelper46.SCALE
'''


def test_a_module_a_plugin_imports_while_decoding_is_said(tmp_path, monkeypatch):
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "lazyhelper46.py").write_text("SCALE = 1.0\n")
    (tmp_path / "lazy.py").write_text(LAZY)
    monkeypatch.syspath_prepend(str(helpers))
    res = _cli(["run", "--model", "tiny-random", "--scorer", f"{tmp_path / 'lazy.py'}:Lazy", "--budget", "24",
                "--interval", "4", "--limit", "1", "--max-new-tokens", "30", "--out", str(tmp_path / "runs"),
                "--quiet", "--no-grade", "--batch-size", "1"])
    line = _one_line(res)
    assert f"imported {(helpers / 'lazyhelper46.py').resolve()} while decoding: not part of its identity" in line
    sys.modules.pop("lazyhelper46", None)
