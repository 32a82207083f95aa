"""Every option of every command, fed bad values: one `Error:` line, exit 1, nothing written.

The matrix is generated from the click commands themselves: each option's bad values come from its
click type (integers, floats, ranges, choices, paths) plus, for free-form strings, the table
`STRING_BAD` below. A new string option must be added to `STRING_BAD` or to `FREE_TEXT` (any
value is meaningful), otherwise `test_every_string_option_is_classified` fails. Base arguments are
valid and cheap, so a bad value that slipped through would show as a passing command.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from retention.cli import main

MANIFEST = None  # filled lazily (the committed manifest's hash)


def _walk(cmd, prefix=()):
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from _walk(sub, (*prefix, name))
    else:
        yield prefix, cmd


COMMANDS = dict(_walk(main))

# Valid, cheap base arguments per command (relative paths live in the test's working folder).
BASE = {
    ("run",): ["--model", "tiny-random", "--scorer", "streaming", "--budget", "64", "--limit", "1",
               "--max-new-tokens", "2", "--out", "out", "--quiet"],
    ("calibrate",): ["--model", "tiny-random", "--tokens", "32", "--out", "out/stats.safetensors"],
    ("bench",): ["--model", "tiny-random", "--scorer", "full,streaming", "--max-new-tokens", "2", "--problems", "0"],
    ("grade",): ["in/records.jsonl"],
    ("splits", "verify"): [],
    ("splits", "show"): ["--split", "dev"],
    ("stats",): ["in/outcomes.csv", "--treatment", "t", "--baseline", "b", "--cluster", "c", "--boot", "50"],
    ("preregister",): ["--out", "out/plans", "--model", "tiny-random", "--budget", "64", "--treatment",
                       '{"scorer": "streaming"}', "--baseline", '{"scorer": "random"}', "-k", "1",
                       "--max-new-tokens", "8", "--code-version", "x"],
    ("confirm",): ["--plan", "in/plan.json", "--out", "out/confirm", "--code-version", "0.1.0+gtest",
                   "--runner", "tests.protocol.test_prereg:cli_runner"],
    ("report",): ["in/runs", "--boot", "50", "--out", "out/report"],
    ("view",): ["in/runs", "--boot", "50", "--out", "out/viewer", "--tokenizer", "none"],
    ("audit",): ["mha"],
    ("agree",): ["in/run_a", "in/run_b"],
    ("conformance",): [],
    ("merge",): ["in/runs", "--out", "out/merged"],
    ("check-scorer",): ["streaming", "--context", "0"],
    ("check",): ["state:quant"],
    ("reproduce",): ["in/run_a", "--limit", "1"],
    ("size",): ["--model", "tiny-random", "--dtype", "float32", "--limit", "2", "--seconds", "60",
                "--max-new-tokens", "2", "--batch-size", "2", "--out", "out/sizing.json"],
}

# Known-bad values of free-form string options, per (command, option) or option.
STRING_BAD = {
    "--model": ["no-such-model", ""],
    "--scorer": ["nope", ","],
    ("run", "--baseline"): ["nope"],
    ("report", "--baseline"): ["no-such-run"],
    ("view", "--baseline"): ["no-such-run"],
    ("preregister", "--baseline"): ["{", "[1]", "@in/missing.json", "@in/binary.bin", '{"scorer": 1}',
                                    '{"scorer": "nope"}', '{"scorer": "random", "temperature": "hot"}',
                                    '{"scorer": "random", "temperature": -1}', '{"scorer": "random", "interval": 0}',
                                    '{"scorer": "random", "nope": 1}', "[" * 100_000],
    ("preregister", "--treatment"): ["{", '{"scorer": "nope"}', '{"scorer": "streaming", "top_p": 1e-300}',
                                     '{"scorer": "streaming", "scorer_params": {"lam": 0.5}}'],
    "--treatment-set": ["novalue", "scorer_params.nope=1", "temperature=-1"],
    "--baseline-set": ["novalue", "scorer=nope", "top_p=0"],
    "--device": ["tpu", "cuda:x"],
    ("preregister", "--budget"): ["x", "-3", "0", "2"],
    "--model-revision": ["norev", "other-model=rev"],
    "--manifest-hash": ["xyz", "0" * 64],
    "--cell": ["nope@b1"],
    "--override": ["novalue", "split=dev"],
    "--runner": ["nomodule", "no.such.module:f", "os:nosuchattr", "json:dumps"],
    "--supersedes": ["xyz", "0" * 64],
    ("bench", "--accounting"): ["nope", ","],
    "--param": ["novalue", "streaming.nope=1", "alpha.lam=0.5", ".=1"],
    ("run", "--ray"): ["", "local"],  # empty address; a cluster without --shards
    "--shard": ["x", "2/2", "0/0", "-1/3", "1/2/3"],
    ("bench", "--batch-sizes"): ["x", "0", "-2", ","],
    ("bench", "--context"): ["x", "0", "1.5"],
    ("bench", "--layouts"): ["nope", ",", "mha,nope"],
    ("bench", "--dtype"): ["bf16", ",", "float32,bfloat16", "float32,float32"],
    ("bench", "--engine"): ["nope", ",", "hf,nope", "vllm,vllm"],
    ("audit", "targets"): ["no-such-layout"],
    ("check-scorer", "spec"): ["nope", "no_such_module:X", "in/afile:X", "in/missing.py:X", "os:path"],
    ("check", "target"): ["nope", "state:nope", "decoding:in/missing.py:X", "cadence:os:path", "routing:"],
    ("check", "--param"): ["novalue", "quant.bitz=4", "quant.bits=x", "other.k=1"],
    ("check", "--scorer"): ["nope", "in/missing.py:X"],
    ("run", "--cadence"): ["nope", "in/missing.py:X", "os:path"],
    ("run", "--routing"): ["nope", "in/missing.py:X"],
    ("run", "--state"): ["nope", "in/afile:X"],
    ("run", "--decoding"): ["nope", "retention.policy.state.quant:Quant"],
    ("stats", "--treatment"): ["nocolumn"],
    ("stats", "--baseline"): ["nocolumn"],
    ("stats", "--cluster"): ["nocolumn"],
    ("stats", "--sample"): ["nocolumn"],
}
# String options where any value is meaningful.
FREE_TEXT = {"--code-version", "--note", "--reason"}
# Options whose huge values are legitimate caps (a limit above the split size takes the split).
HUGE_OK = {"--limit", "--budget"}


def _string_bad(cmd, opt):
    return STRING_BAD.get((cmd[-1] if cmd[0] != "splits" else cmd[0], opt), STRING_BAD.get(opt))


def _bad_values(cmd: tuple, param: click.Parameter) -> list[str]:
    opt = param.opts[0] if isinstance(param, click.Option) else param.name
    t = param.type
    if isinstance(t, click.Choice):
        return ["no-such-choice"]
    if isinstance(t, (click.IntRange, click.types.IntParamType)):
        vals = ["x", "1.5", "-1"]
        if opt not in HUGE_OK:
            vals.append("99999999999999999999")
        if isinstance(t, click.IntRange) and t.min is not None and t.min > 0:
            vals.append(str(t.min - 1))
        if (cmd, opt) in {(("run",), "--seed")}:
            vals.remove("-1")  # a negative base seed is refused by validate_arm (kept below)
            vals.append("-1")
        return vals
    if isinstance(t, (click.FloatRange, click.types.FloatParamType)):
        vals = ["x", "nan", "inf", "-inf"]
        if opt in ("--temperature", "--lambda", "--timeout"):
            vals.append("-1")
        if opt == "--top-p":
            vals += ["0", "1.5", "1e-300"]
        if opt == "--other-p":
            vals.append("2")
        return vals
    if isinstance(t, click.Path):
        if opt in ("--out",) or (cmd == ("preregister",) and opt == "--out"):
            vals = ["in/afile/sub", "/proc/nonexistent/x"]
            if not t.file_okay:
                vals.append("in/afile")
            return vals
        vals = ["in/missing"]
        if t.dir_okay and not t.file_okay:
            vals += ["in/afile"]
        else:
            vals += ["in/adir", "in/binary.bin"]
        if opt in ("--data",):
            vals += ["in/deep.jsonl", "in/records.jsonl"]
        if opt == "--stats":
            vals += ["in/afile"]
        if opt == "--plan":
            vals += ["in/deep.jsonl", "in/not-a-plan.json"]
        return vals
    if isinstance(t, click.types.StringParamType):
        bad = _string_bad(cmd, opt)
        if bad is not None:
            return bad
        return []
    return []


def _cases():
    for cmd, command in COMMANDS.items():
        for param in command.params:
            if isinstance(param, click.Option) and (param.is_flag or param.name == "help"):
                continue
            for value in _bad_values(cmd, param):
                yield cmd, param, value


CASES = list(_cases())


def _args(cmd, param, value) -> list[str]:
    base = list(BASE[cmd])
    if isinstance(param, click.Argument):
        # replace the positional
        base = base[1:] if cmd == ("check-scorer",) else [a for a in base if not a.startswith("in/")]
        return [*cmd, value, *base]
    opt = param.opts[0]
    # drop the base's own value of this option (so the bad one is the one used)
    out, skip = [], False
    names = set(param.opts) | set(param.secondary_opts)
    for a in base:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        out.append(a)
    return [*cmd, *out, opt, value]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A working folder with valid inputs under in/ (never changed by a test) and its registry."""
    from protocol import prereg
    from tests.protocol.test_report import make_run

    root = tmp_path_factory.mktemp("matrix")
    state = root / "state"
    old = os.environ.get("RETENTION_STATE_DIR")
    os.environ["RETENTION_STATE_DIR"] = str(state)
    d = root / "w"
    inp = d / "in"
    inp.mkdir(parents=True)
    (inp / "afile").write_text("x\n")
    (inp / "adir").mkdir()
    (inp / "binary.bin").write_bytes(b"\xff\xfe\x00\x81garbage\n")
    (inp / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    (inp / "not-a-plan.json").write_text('{"plan": 1}\n')
    (inp / "records.jsonl").write_text(json.dumps({"pred": "\\boxed{2}", "gold": "2"}) + "\n")
    (inp / "outcomes.csv").write_text("c,t,b\n" + "".join(f"p{i},{i % 2},{(i // 2) % 2}\n" for i in range(20)))
    alpha = make_run(inp / "runs", scorer="alpha", n=10, k=1)
    shutil.copytree(alpha, inp / "run_a")
    shutil.copytree(alpha, inp / "run_b")
    make_run(inp / "runs", scorer="triattention", n=10, k=1, shift=0.1, seed=1)
    from protocol.splits import manifest_sha256
    from tests.protocol.test_prereg import new_plan

    plan = new_plan(models=["tiny-random"], manifest_hash=manifest_sha256(),
                    treatment={"scorer": "streaming"}, baseline={"scorer": "random"})
    prereg.write_plan(plan, inp / "plan.json")
    if old is None:
        del os.environ["RETENTION_STATE_DIR"]
    else:
        os.environ["RETENTION_STATE_DIR"] = old
    return d, state


@pytest.fixture
def workdir(inputs, monkeypatch):
    d, state = inputs
    monkeypatch.setenv("RETENTION_STATE_DIR", str(state))
    monkeypatch.chdir(d)
    return d


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if ".lock" not in p.name}


@pytest.mark.parametrize("cmd,param,value", CASES,
                         ids=[f"{' '.join(c)} {p.opts[0] if isinstance(p, click.Option) else p.name}={v[:20]!r}"
                              for c, p, v in CASES])
def test_bad_value_gives_one_error_line_and_writes_nothing(workdir, cmd, param, value):
    before = _snapshot(workdir)
    state = Path(os.environ["RETENTION_STATE_DIR"])
    state_before = _snapshot(state)
    res = CliRunner().invoke(main, _args(cmd, param, value))
    out = res.output
    errors = [line for line in out.splitlines() if line.startswith("Error:")]
    assert res.exit_code == 1, out
    assert len(errors) == 1 and "Traceback" not in out, out
    assert out.strip().splitlines()[-1] == errors[0]
    assert _snapshot(workdir) == before, "a refused command wrote files"
    assert _snapshot(state) == state_before, "a refused command registered something"


def test_matrix_covers_every_command_and_option():
    covered = {(c, p.name) for c, p, _ in CASES}
    for cmd, command in COMMANDS.items():
        for p in command.params:
            if isinstance(p, click.Option) and (p.is_flag or p.name == "help"):
                continue
            opt = p.opts[0] if isinstance(p, click.Option) else p.name
            if opt in FREE_TEXT:
                continue
            assert (cmd, p.name) in covered, f"{' '.join(cmd)} {opt}: no bad value in the matrix"
    print(f"bad-input matrix: {len(CASES)} cases over {len(COMMANDS)} commands")


def test_every_string_option_is_classified():
    for cmd, command in COMMANDS.items():
        for p in command.params:
            if isinstance(p, click.Option) and isinstance(p.type, click.types.StringParamType) and not p.is_flag:
                opt = p.opts[0]
                assert opt in FREE_TEXT or _string_bad(cmd, opt) is not None, f"{' '.join(cmd)} {opt}"
