"""`results/tail-qwen0.5b/`: the README's figures are its logs' and bench JSONs', and the four real runs
(two pairs, the tail narrowed and not) wrote the same records but for their timing fields."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parents[2] / "results" / "tail-qwen0.5b"
RUN = "qwen2.5-coder-0.5b-triattention-b128-1628c0eae6"
TIMING = ("wall_seconds", "tokens_per_second")
PAIRS = {"1": "", "2": "-8f30cc2"}  # pair -> file suffix


def run_records(folder: Path) -> dict:
    """The records of the run in `folder` by (problem, sample), without their timing fields."""
    out = {}
    for line in (folder / RUN / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[(r["problem_id"], r["sample"])] = {k: v for k, v in r.items() if k not in TIMING}
    return out


def _prof(variant: str) -> dict:
    log = (FOLDER / f"{variant}.log").read_text()
    m = re.search(r"PROF steps (\d+) tokens (\d+) decode ([\d.]+)s .* padding_rows (\d+) narrowed (\d+) "
                  r"\(refused (\d+), last rows (\d+), ([\d.]+)s\)", log)
    g = re.search(r"generated (\d+) output tokens in ([\d.]+) s: ([\d.]+) tok/s", log)
    assert m and g, variant
    steps, tokens, decode, pad, narrowed, refused, rows, tail_s = m.groups()
    return {"steps": int(steps), "tokens": int(tokens), "decode": float(decode), "pad": int(pad),
            "narrowed": int(narrowed), "refused": int(refused), "rows": int(rows), "tail_s": float(tail_s),
            "out": int(g.group(1)), "wall": float(g.group(2)), "tps": float(g.group(3))}


def _bench(suffix: str) -> dict:
    bench = json.loads((FOLDER / f"bench-b64{suffix}.json").read_text())
    return {r["variant"]: r["tokens_per_second"] for r in bench["speed"] if r["batch_size"] == 64}


def test_the_runs_wrote_the_same_records():
    base = run_records(FOLDER / "dev-no-tail")
    assert len(base) == 201
    for suffix in PAIRS.values():
        for v in ("dev-no-tail", "dev-tail"):
            got = run_records(FOLDER / (v + suffix))
            assert got.keys() == base.keys()
            for key in base:
                assert got[key] == base[key], (v + suffix, key)
    assert {r["slots"] for r in base.values()} == {64}
    assert sum(r["verdict"] is True for r in base.values()) == 10


@pytest.mark.parametrize("pair", PAIRS)
def test_the_table_is_the_logs(pair):
    suffix = PAIRS[pair]
    readme = (FOLDER / "README.md").read_text()
    speed = _bench(suffix)
    bench_line = ", ".join(f"{name} {speed[v]:.1f}" for name, v in (("full", "full"), ("TriAttention", "triattention"),
                                                                    ("α", "alpha")))
    assert f"(`bench-b64{suffix}.json`) {bench_line} tok/s" in readme
    runs = {}
    for variant, label in (("dev-no-tail", "all 64 rows"), ("dev-tail", "narrowed")):
        p = _prof(variant + suffix)
        tokens = sum(r["output_tokens"] for r in run_records(FOLDER / (variant + suffix)).values())
        assert p["tokens"] == p["out"] == tokens
        assert p["tps"] == pytest.approx(tokens / p["wall"], abs=0.05)
        share = f"{round(100 * p['tps'] / speed['triattention'])}%"
        if variant == "dev-tail":
            share = f"**{share}**"
        narrowings = f"{p['narrowed']} ({p['refused']} refused)" if p["narrowed"] else "0"
        cells = [f"{tokens:,}", f"{p['wall']:.1f}", f"{p['tps']:.1f}", f"{share} of {speed['triattention']:.1f}",
                 f"{p['decode']:.1f}", f"{p['pad']:,}", narrowings]
        row = f"| {pair} | {label} (`{variant}{suffix}.log`) | " + " | ".join(cells) + " |"
        assert row in readme, row
        runs[variant] = p
    off, on = runs["dev-no-tail"], runs["dev-tail"]
    # Every decode row-step of a sequence gives one token (its first comes from its prefill): the rest is padding.
    assert off["steps"] == on["steps"] == 1742 and off["pad"] == off["steps"] * 64 - (off["tokens"] - 201) == 30119
    assert off["narrowed"] == 0 and off["rows"] == 64 and on["rows"] == 2 and on["narrowed"] == 5
    assert f"{on['tail_s']:.1f} s" in readme and f"{off['wall'] / on['wall']:.2f}×" in readme
    assert round(100 * on["tps"] / speed["triattention"]) >= 70


def test_the_speed_page_quotes_the_table():
    main = (FOLDER.parent.parent / "docs" / "speed.md").read_text()
    for suffix in PAIRS.values():
        speed = _bench(suffix)
        off, on = _prof("dev-no-tail" + suffix), _prof("dev-tail" + suffix)
        shares = [round(100 * p["tps"] / speed["triattention"]) for p in (off, on)]
        pairs = [(f"{off['tps']:.1f}", f"{on['tps']:.1f}"), (f"{shares[0]}%", f"{shares[1]}%"),
                 (f"{off['wall']:.1f}", f"{on['wall']:.1f}")]
        for text in [f"{x} → {y}" for x, y in pairs] + [f"{speed['triattention']:.1f}"]:
            assert text in main, text


def test_the_row_count_sentences_are_the_measurement():
    rc = (FOLDER / "row-counts.txt").read_text()
    lines = {line.split(":")[0]: line.split(":", 1)[1].strip() for line in rc.splitlines() if ":" in line}
    qwen_bf16 = {k: v for k, v in lines.items() if k.startswith("qwen2.5-coder-0.5b bfloat16") and "x" in k.split()[2]}
    assert len(qwen_bf16) == 5
    for k, v in qwen_bf16.items():  # the same at every row count but the down projection at 1 row
        assert v == ("differ at ordinary [] order-revealing [1]" if "4864x896" in k else
                     "differ at ordinary [] order-revealing []"), k
    float32 = [v for k, v in lines.items() if k.startswith("qwen2.5-coder-0.5b float32")]
    assert len(float32) == 5 and set(float32) == {"differ at ordinary [1, 2, 3, 5, 6, 7, 9, 10, 11] "
                                                  "order-revealing [1, 2, 3, 5, 6, 7, 9, 10, 11]"}
    assert lines["qwen2.5-coder-0.5b bfloat16 attention over 191 keys of 64 rows"] == "differs at []"
    for dt in ("bfloat16", "float32"):  # SmolLM2's attention: over 79 and 336 keys, at every narrower count
        for keys, want in ((79, "[8, 4, 2, 1]"), (170, "[]"), (336, "[8, 4, 2, 1]")):
            assert lines[f"smollm2-135m {dt} attention over {keys} keys of 16 rows"] == f"differs at {want}"
