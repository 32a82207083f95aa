"""`results/slow-host/`: the README's figures are those its logs, notes and bench JSONs hold."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from retention.runs.sizing import JobShape, fit_or_lighten, step_line

FOLDER = Path(__file__).resolve().parents[2] / "results" / "slow-host"


def _elapsed(log: str) -> float:
    m, s = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\d+):([0-9.]+)", log).groups()
    return 60 * int(m) + float(s)


@pytest.mark.parametrize("log,seconds", [("make-run-before.log", 601.9), ("make-run.log", 586.3),
                                         ("make-run-small.log", 515.1), ("make-run-this-host.log", 483.1)])
def test_each_make_time_is_its_log(log, seconds):
    text = (FOLDER / log).read_text()
    assert round(_elapsed(text), 1) == seconds and "rc=0" in text
    assert f"**{seconds} s**" in (FOLDER / "README.md").read_text()


@pytest.mark.parametrize("job", ["make-run", "make-run-small"])
def test_the_sizing_note_is_the_line_the_job_printed_and_its_records(job):
    note = json.loads((FOLDER / job / "runs" / "sizing.json").read_text())
    log = (FOLDER / f"{job}.log").read_text()
    assert f"retention size: {note['line']}" in log
    runs = [d for d in (FOLDER / job / "runs").iterdir() if d.is_dir()]
    assert len(runs) == 3
    for run in runs:
        recs = [json.loads(x) for x in (run / "records.jsonl").read_text().splitlines() if x.strip()]
        cfg = json.loads((run / "config.json").read_text())["config"]
        assert len(recs) == note["problems"] and cfg["max_new_tokens"] == note["tokens"]
        assert bool(cfg.get("fidelity")) == (note["fidelity"] and not run.name.split("-")[-2] == "full")


def test_the_slowdown_is_the_bench_pair():
    speed = {w: {r["batch_size"]: r["tokens_per_second"] for r in json.loads((FOLDER / f"bench-smollm2-{w}.json")
                                                                               .read_text())["speed"]}
             for w in ("host", "cgroup")}
    readme = (FOLDER / "README.md").read_text()
    row = (f"| slower by | {speed['host'][1] / speed['cgroup'][1]:.1f}x | "
           f"{speed['host'][16] / speed['cgroup'][16]:.1f}x |")
    assert row in readme and f"| {speed['cgroup'][1]:.2f} | {speed['cgroup'][16]:.1f} |" in readme


def test_the_margins_choice_on_this_host_is_its_note():
    n = json.loads((FOLDER / "make-run-this-host-sizing.json").read_text())
    line = step_line([(s, t / 1e3) for s, t in zip(n["steps"]["slots"], n["steps"]["step_ms"])])
    fill = step_line([(s, t / 1e3) for s, t in zip(n["steps"]["slots"], n["steps"]["prefill_ms"])])
    fit = {m: fit_or_lighten(16, JobShape(**n["shape"]), line, n["load_seconds"], n["seconds_left"], m, prefill=fill)
           for m in (0.6, 0.7)}
    assert fit[0.6][:2] == (n["problems"], n["tokens"]) == (16, 640) and fit[0.7][:2] == (15, 768)
    assert f"retention size: {n['line']}" in (FOLDER / "make-run-this-host.log").read_text()
