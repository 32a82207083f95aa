"""`results/bench-llamacpp/`: the tables its README and docs/speed.md quote are those of its JSON files.

Each run's table is rebuilt from the JSON's `comparison` rows by the bench's own formatter and must
appear verbatim in the README (as printed); docs/speed.md's rows must state the same figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from retention.runs.engine_bench import Comparison, format_table

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "results" / "bench-llamacpp"
RUNS = ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")


def _figures(name: str) -> dict:
    return json.loads((FOLDER / f"{name}.json").read_text())


@pytest.mark.parametrize("name", RUNS)
def test_readme_table_is_the_json_table(name):
    fig = _figures(name)
    rows = [Comparison(**{**c, "arms": ()}) for c in fig["comparison"]]
    table = format_table(rows, fig["engines"])
    readme = (FOLDER / "README.md").read_text()
    assert "\n".join("    " + line for line in table.splitlines()) in readme, table
    assert table in (FOLDER / f"{name}.log").read_text()  # as the command printed it
    run = fig["llamacpp_run"]
    assert run["version"] == "0.3.36" and run["flags"]["kv_unified"] is False
    assert [(r["batch_size"], r["generated_tokens"]) for r in fig["llamacpp"]] == [(1, 64), (16, 1024), (64, 4096)]


@pytest.mark.parametrize("name", RUNS)
def test_speed_doc_rows_are_the_json(name):
    doc = (ROOT / "docs" / "speed.md").read_text()
    for c in _figures(name)["comparison"]:
        row = (f"| `{name}` | {c['batch_size']} | {c['hf_tokens_per_second']:.1f} | "
               f"{c['llamacpp_tokens_per_second']:.1f} | {c['ratio_hf_llamacpp']:.2f} |")
        assert row in doc, row
