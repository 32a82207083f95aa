"""Sizing a job to the host (retention.runs.sizing, `retention size`, scripts/main_job.sh with DEADLINE):
the cost model recomputed by hand, the choice at its boundary, and the job as `make run` runs it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.runs.sizing import JobShape, Sizing, StepLine, fit_job, fit_or_lighten, predicted_seconds, step_line

ROOT = Path(__file__).resolve().parents[3]


def by_hand(p, tokens, batch, caches, a, b, load, commands, arms=3, pa=0.0, pb=0.0):
    s = min(batch, p)
    return commands * load + math.ceil(p / s) * (tokens * caches * (a + b * s) + arms * (pa + pb * s))


@pytest.mark.parametrize("fidelity", [True, False])
def test_the_prediction_is_the_stated_cost_model(fidelity):
    shape = JobShape(tokens=300, batch=8, retention_arms=2, full_arms=1, fidelity=fidelity, commands=2)
    line = StepLine(a=0.02, b=0.003)
    caches = 2 + 1 + (2 if fidelity else 0)
    fill = StepLine(a=0.5, b=0.2)
    for p in (1, 3, 8, 9, 16, 17, 40):
        assert predicted_seconds(p, shape, line, 5.0) == pytest.approx(by_hand(p, 300, 8, caches, 0.02, 0.003, 5.0, 2))
        assert predicted_seconds(p, shape, line, 5.0, fill) == pytest.approx(
            by_hand(p, 300, 8, caches, 0.02, 0.003, 5.0, 2, pa=0.5, pb=0.2))


def test_the_job_that_generates_the_most_tokens_within_the_margin_is_chosen():
    """Every time left from nothing to more than enough: the choice is, among all (P, T) on the grid
    whose hand-computed time is within the margin, the most P x T (then the longest T); never more
    than asked, and the smallest job when nothing fits."""
    shape = JobShape(tokens=300, batch=8)
    line = StepLine(a=0.01, b=0.002)
    grid = [300, 256, 192, 128]  # 64-token steps from min_tokens, plus the requested limit
    need = {(p, t): by_hand(p, t, 8, 5, 0.01, 0.002, 3.0, 2) for p in range(2, 17) for t in grid}
    for left in [0.0, 10.0, need[(2, 128)] / 0.8, need[(8, 300)] / 0.8 + 1e-6, need[(9, 300)] / 0.8 - 1e-6,
                 need[(16, 192)] / 0.8, 1e6]:
        p, t, sec = fit_job(16, shape, line, 3.0, left, 0.8)
        fitting = [pt for pt in need if need[pt] <= 0.8 * left]
        want = max(fitting, key=lambda pt: (pt[0] * pt[1], pt[1])) if fitting else (2, 128)
        assert (p, t) == want and sec == pytest.approx(need[want])
    assert fit_job(16, shape, line, 3.0, 1e6, 0.8)[:2] == (16, 300)
    # one slot costs almost what eight do: a slow host keeps its problems and shortens the answers
    flat = StepLine(a=0.1, b=0.0001)
    p, t, _ = fit_job(8, shape, flat, 0.0, by_hand(8, 192, 8, 5, 0.1, 0.0001, 0.0, 2) / 0.8, 0.8)
    assert (p, t) == (8, 192)


def test_the_fidelity_proxy_goes_only_when_the_smallest_job_with_it_does_not_fit():
    """Around the boundary where the smallest job with the proxy (5 caches a step) stops fitting: up
    to it the proxy stays (answers shorten first); past it the job is fitted again with 3 caches,
    and may then keep longer answers than the smallest job with the proxy."""
    shape = JobShape(tokens=300, batch=8)
    line = StepLine(a=0.01, b=0.002)
    smallest = by_hand(2, 128, 8, 5, 0.01, 0.002, 3.0, 2)
    p, t, sec, fid = fit_or_lighten(16, shape, line, 3.0, smallest / 0.8, 0.8)
    assert (p, t, fid) == (2, 128, True) and sec == pytest.approx(smallest)
    left = smallest / 0.8 - 1e-6
    p, t, sec, fid = fit_or_lighten(16, shape, line, 3.0, left, 0.8)
    lean = {(p, t): by_hand(p, t, 8, 3, 0.01, 0.002, 3.0, 2) for p in range(2, 17) for t in [300, 256, 192, 128]}
    want = max((pt for pt in lean if lean[pt] <= 0.8 * left), key=lambda pt: (pt[0] * pt[1], pt[1]))
    assert not fid and (p, t) == want and sec == pytest.approx(lean[want]) and p * t > 2 * 128
    # a job asked without the proxy is only fitted
    assert fit_or_lighten(16, JobShape(tokens=300, batch=8, fidelity=False), line, 3.0, 0.0, 0.8)[3] is False
    sized = Sizing(requested=16, problems=p, requested_tokens=300, tokens=t, seconds_left=left, predicted_seconds=sec,
                   load_seconds=3.0, margin=0.8, shape={"fidelity": True}, steps={"slots": [1, 8], "step_ms": [12, 26],
                                                                                  "prefill_ms": [0, 0]},
                   fidelity=False)
    assert "without the fidelity proxy (the smallest job with it does not fit)" in sized.line()


def test_the_step_line_goes_through_its_two_points_and_never_below_zero():
    line = step_line([(1, 0.05), (16, 0.2)])
    assert line.a + line.b == pytest.approx(0.05) and line.a + 16 * line.b == pytest.approx(0.2)
    flat = step_line([(1, 0.3), (16, 0.2)])  # noise tilted it: no negative slope
    assert flat.b == 0.0 and flat.a == pytest.approx(0.2)
    one = step_line([(4, 0.2)])
    assert one.a == 0.0 and one.b == pytest.approx(0.05)


def test_size_prints_the_count_and_writes_the_note(tmp_path):
    note = tmp_path / "runs" / "sizing.json"
    res = CliRunner().invoke(main, ["size", "--model", "tiny-random", "--dtype", "float32", "--limit", "6",
                                    "--seconds", "3600", "--max-new-tokens", "16", "--batch-size", "4",
                                    "--out", str(note)])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "6 16 fidelity" and "all 6 problems at 16 new tokens fit" in res.stderr
    got = json.loads(note.read_text())
    assert got["problems"] == 6 and got["requested"] == 6 and got["tokens"] == 16 and got["steps"]["slots"] == [1, 4]
    line = step_line([(s, t / 1e3) for s, t in zip(got["steps"]["slots"], got["steps"]["step_ms"])])
    fill = step_line([(s, t / 1e3) for s, t in zip(got["steps"]["slots"], got["steps"]["prefill_ms"])])
    assert got["predicted_seconds"] == pytest.approx(predicted_seconds(6, JobShape(**got["shape"]), line,
                                                                       got["load_seconds"], fill))
    assert all(t > 0 for t in got["steps"]["prefill_ms"])
    # a host with no time left: the smallest job, and the line says it does not fit
    res = CliRunner().invoke(main, ["size", "--model", "tiny-random", "--dtype", "float32", "--limit", "6",
                                    "--seconds", "0", "--max-new-tokens", "100000", "--batch-size", "4"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "2 128 no-fidelity" and "does not fit" in res.stderr
    assert "sized to 2 of 6 problems at 128 of 100000 new tokens without the fidelity proxy" in res.stderr
    res = CliRunner().invoke(main, ["size", "--model", "tiny-random", "--dtype", "float32", "--limit", "6",
                                    "--seconds", "0", "--max-new-tokens", "100000", "--batch-size", "4",
                                    "--no-fidelity"])
    assert res.exit_code == 0 and res.stdout.strip() == "2 128 no-fidelity" and "fidelity proxy" not in res.stderr


def test_size_refuses_a_job_without_arms():
    res = CliRunner().invoke(main, ["size", "--model", "tiny-random", "--limit", "6", "--seconds", "60",
                                    "--max-new-tokens", "16", "--batch-size", "4", "--retention-arms", "0",
                                    "--full-arms", "0"])
    assert res.exit_code != 0 and "at least one arm" in res.output


def test_the_main_job_with_a_deadline_states_its_sizing_in_the_report(tmp_path):
    """scripts/main_job.sh as `make run` runs it (DEADLINE set): the runs hold the count `retention
    size` chose, and the report prints the note."""
    cli = tmp_path / "retention"
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m retention.cli "$@"\n')
    cli.chmod(0o755)
    out = tmp_path / "job"
    env = dict(os.environ, MODEL="tiny-random", PROBLEMS="3", TOKENS="12", BATCH="4", BUDGET="40", DTYPE="float32",
               DEADLINE=str(int(time.time()) + 3600), OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", str(ROOT / "scripts" / "main_job.sh"), str(cli), str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    note = json.loads((out / "runs" / "sizing.json").read_text())
    assert note["problems"] == 3 and "retention size: all 3 problems at 12 new tokens fit" in res.stderr
    assert "note: tiny-random: this job was all 3 problems at 12 new tokens fit" in res.stdout
    for d in (out / "runs").iterdir():
        if d.is_dir():
            assert len((d / "records.jsonl").read_text().splitlines()) == 3
