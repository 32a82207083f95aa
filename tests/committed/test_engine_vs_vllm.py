"""`results/engine-vs-vllm/`: the README's side-by-side table is its bench JSON, row for row.

Each row of the JSON's `comparison` (this engine's full arm alone, vLLM, their ratio, the full arm
beside the arms and each arm with its ratio to it) must appear in the README's table as printed
there, and every ratio must be the quotient of the two figures it relates (recomputed here from the
JSON's per-variant rows, not read). The full arm alone at 64 slots from the separate bench, and the
one-lockstep run of the older code, back the README's sentence on lockstep interference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "results" / "engine-vs-vllm"
SPEED_PAGE = FOLDER.parent.parent / "docs" / "speed.md"


def _json(name: str) -> dict:
    return json.loads((FOLDER / name).read_text())


@pytest.mark.parametrize("name,arms", [("smollm2", ["alpha", "triattention", "dynamic-cache", "ideal-crop"]),
                                       ("qwen0.5b", ["alpha", "triattention"])])
def test_the_table_is_the_json(name, arms):
    fig = _json(f"bench-{name}-bf16.json")
    readme = (FOLDER / "README.md").read_text()
    assert fig["arms"] == arms and fig["budget"] == 128
    assert fig["new_tokens"] == 256 and fig["contexts"] == [256] and fig["threads"] == 2
    hf = {(h["pass"], h["variant"], h["batch_size"]): h["tokens_per_second"] for h in fig["hf"]}
    vllm = {v["batch_size"]: v["tokens_per_second"] for v in fig["vllm"]}
    for c in fig["comparison"]:
        bs = c["batch_size"]
        assert c["hf_tokens_per_second"] == hf[("alone", "full", bs)] and c["vllm_tokens_per_second"] == vllm[bs]
        assert c["ratio_hf_vllm"] == pytest.approx(hf[("alone", "full", bs)] / vllm[bs])
        base = hf[("arms", "full", bs)]
        assert c["lockstep_full_tokens_per_second"] == base
        cells = [f"{c['hf_tokens_per_second']:.1f}", f"{c['vllm_tokens_per_second']:.1f}", f"{c['ratio_hf_vllm']:.2f}",
                 f"{base:.1f}"]
        for a in c["arms"]:
            assert a["ratio_to_full"] == pytest.approx(hf[("arms", a["name"], bs)] / base)
            cells += [f"{a['tokens_per_second']:.1f}", f"{a['ratio_to_full']:.2f}"]
        row = f"| {bs} | " + " | ".join(cells) + " |"
        assert row in readme, row
        if name == "smollm2":  # docs/speed.md's table of the same run
            short = f"| {bs} | " + " | ".join(cells[:4] + [f"{a['ratio_to_full']:.2f}" for a in c["arms"]]) + " |"
            assert short in SPEED_PAGE.read_text(), short
        else:  # its sentence
            assert f"{c['ratio_hf_vllm']:.2f}" in SPEED_PAGE.read_text()


def test_the_lockstep_interference_sentence():
    alone = _json("bench-smollm2-bf16-full-alone-b64.json")["speed"]
    (full,) = [r for r in alone if r["variant"] == "full" and r["batch_size"] == 64]
    one = _json("bench-smollm2-bf16-one-lockstep.json")
    beside = [h for h in one["hf"] if h["variant"] == "full" and h["batch_size"] == 64]
    assert len(beside) == 1 and "pass" not in beside[0]  # the older code: one lockstep of all five variants
    readme = (FOLDER / "README.md").read_text()
    assert f"{beside[0]['tokens_per_second']:.1f} tok/s beside the four arms" in readme
    assert f"{full['tokens_per_second']:.1f} alone" in readme
