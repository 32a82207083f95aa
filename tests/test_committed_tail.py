"""`results/tail-qwen0.5b/`: the README's figures are its logs' and bench JSON's, and the two real runs
(the tail narrowed and not) wrote the same records but for their timing fields."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

FOLDER = Path(__file__).resolve().parent.parent / "results" / "tail-qwen0.5b"
RUN = "qwen2.5-coder-0.5b-triattention-b128-1628c0eae6"
TIMING = ("wall_seconds", "tokens_per_second")


def _records(variant: str) -> dict:
    out = {}
    for line in (FOLDER / variant / RUN / "records.jsonl").read_text().splitlines():
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


def test_the_runs_wrote_the_same_records():
    off, on = _records("dev-no-tail"), _records("dev-tail")
    assert len(off) == 201 and off.keys() == on.keys()
    for key in off:
        assert on[key] == off[key], key
    assert {r["slots"] for r in on.values()} == {64}
    assert sum(r["verdict"] is True for r in on.values()) == 10


def test_the_table_is_the_logs():
    readme = (FOLDER / "README.md").read_text()
    bench = json.loads((FOLDER / "bench-b64.json").read_text())
    speed = {r["variant"]: r["tokens_per_second"] for r in bench["speed"] if r["batch_size"] == 64}
    for v in ("full", "triattention", "alpha"):
        assert f"{speed[v]:.1f}" in readme, v
    rows = {}
    for variant, label in (("dev-no-tail", "all 64 rows"), ("dev-tail", "narrowed")):
        p = _prof(variant)
        tokens = sum(r["output_tokens"] for r in _records(variant).values())
        assert p["tokens"] == p["out"] == tokens
        assert p["tps"] == pytest.approx(tokens / p["wall"], abs=0.05)
        share = round(100 * p["tps"] / speed["triattention"])
        narrowings = f"{p['narrowed']} ({p['refused']} refused)" if p["narrowed"] else "0"
        cells = [f"{tokens:,}", f"{p['wall']:.1f}", f"{p['tps']:.1f}", f"{share}%", f"{p['decode']:.1f}",
                 f"{p['pad']:,}", narrowings]
        row = f"| {label} (`{variant}.log`) | " + " | ".join(cells) + " |"
        assert row.replace(f"{share}%", f"**{share}%**") in readme or row in readme, row
        rows[variant] = p
    off, on = rows["dev-no-tail"], rows["dev-tail"]
    # Every decode row-step of a sequence gives one token (its first comes from its prefill): the rest is padding.
    assert off["steps"] == on["steps"] == 1742 and off["pad"] == off["steps"] * 64 - (off["tokens"] - 201) == 30119
    assert off["narrowed"] == 0 and off["rows"] == 64 and on["rows"] == 2 and on["narrowed"] == 5
    assert f"{on['tail_s']:.1f} s" in readme
    assert round(100 * on["tps"] / speed["triattention"]) >= 70
    main = (FOLDER.parent.parent / "README.md").read_text()
    a, b = off, on
    shares = [round(100 * p["tps"] / speed["triattention"]) for p in (a, b)]
    pairs = [(f"{a['tps']:.1f}", f"{b['tps']:.1f}"), (f"{shares[0]}%", f"{shares[1]}%"),
             (f"{a['wall']:.1f}", f"{b['wall']:.1f}"), (f"{a['decode']:.1f}", f"{b['decode']:.1f}"),
             (f"{a['pad']:,}", f"{b['pad']:,}")]
    for text in [f"{x} → {y}" for x, y in pairs] + [f"{on['tail_s']:.1f} s"]:
        assert text in main, text
