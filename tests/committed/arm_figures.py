"""The diagnostics row of a committed run, recomputed from its records and cache traces with code of the tests'
own (not `protocol.diagnostics`, which printed the tables): used by the ladder's and the design space's tests."""

from __future__ import annotations

import json
import re
from pathlib import Path


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loops(ids: list[int]) -> bool:
    """The last 192 ids repeat with a period of 64 or less."""
    tail = ids[-192:]
    return len(ids) >= 192 and any(tail[p:] == tail[:-p] for p in range(1, 65))


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table_rows(readme: Path) -> dict[tuple[str, str], list[str]]:
    """(arm, budget) -> the other cells of each row of the README's diagnostics tables (11 columns)."""
    rows = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and re.fullmatch(r"[0-9.]+ \(\d+/\d+\)", cells[2]):
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def figures(run: Path) -> list[str]:
    """accuracy (correct/n), acc_strict, truncated, looping, compacted, answer after the first compaction, prompt
    held at the end (%), mean cache, mean output tokens: as the tables print them."""
    recs = jsonl(run / "records.jsonl")
    first = {(t["problem_id"], t["sample"]): (t["cache"]["compactions"][0]["step"] if t["cache"]["compactions"] else None)
             for t in jsonl(run / "trace.jsonl")}
    n = len(recs)
    right = [r["verdict"] is True for r in recs]
    after = []
    for r in recs:
        step = first[(r["problem_id"], r["sample"])]
        assert (step is None) == (r["compactions"] == 0)
        after.append(0.0 if step is None else max(r["output_tokens"] - step, 0) / r["output_tokens"])
    held = [r["prompt_held_final"] for r in recs if r["prompt_held_final"] is not None]
    return [f"{pct(sum(right) / n)} ({sum(right)}/{n})",
            pct(sum(ok and r["finish_reason"] != "length" for ok, r in zip(right, recs)) / n),
            pct(sum(r["finish_reason"] == "length" for r in recs) / n),
            pct(sum(loops(r["output_token_ids"]) for r in recs) / n),
            pct(sum(r["compactions"] > 0 for r in recs) / n),
            pct(sum(after) / n),
            pct(sum(held) / len(held)) if held else "-",
            f"{sum(r['cache_mean_tokens'] for r in recs) / n:.1f}",
            f"{sum(r['output_tokens'] for r in recs) / n:.0f}"]
