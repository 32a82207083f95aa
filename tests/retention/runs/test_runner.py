"""Run-directory hardening: one writer, strict resume, no duplicated trace, no foreign records."""

import itertools
import json
from types import SimpleNamespace

import pytest

from protocol.errors import ProtocolError
from retention.errors import RetentionError
from retention.runs.arms import validate_arm
from retention.runs.runner import Arm, RunDir, count_pending
from retention.runs.shard import shard_pairs

CONFIG = {"model": "tiny-random", "scorer": "streaming", "budget": 40, "samples": 2}


def _rec(run, pid, s):
    return {"config_hash": run.hash, "problem_id": pid, "sample": s, "verdict": True}


def _fill(tmp_path, n=3):
    run = RunDir(tmp_path / "r", CONFIG)
    for i in range(n):
        run.append_trace(f"p{i}", 0, [1], [1.0])
        run.records.append(_rec(run, f"p{i}", 0))
    run.close()
    return run


def test_a_second_writer_gets_one_clear_line(tmp_path):
    first = RunDir(tmp_path / "r", CONFIG)
    with pytest.raises(RetentionError, match="another run is writing"):
        RunDir(tmp_path / "r", CONFIG)
    first.close()
    RunDir(tmp_path / "r", CONFIG).close()


def test_corrupt_middle_line_is_refused_with_its_number(tmp_path):
    run = _fill(tmp_path)
    path = run.path / "records.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = '{"problem_id": "p1", "sam\n'
    path.write_text("".join(lines))
    with pytest.raises(ProtocolError, match=r"records\.jsonl:2"):
        RunDir(run.path, CONFIG)
    assert path.read_text() == "".join(lines)  # nothing discarded


def test_half_written_last_line_is_cut_and_valid_lines_kept(tmp_path):
    run = _fill(tmp_path)
    path = run.path / "records.jsonl"
    with open(path, "a") as f:
        f.write('{"problem_id": "p9", "sa')
    again = RunDir(run.path, CONFIG)
    assert sorted(again.records.done) == [("p0", 0), ("p1", 0), ("p2", 0)]
    assert path.read_text().endswith("}\n")


def test_kill_between_trace_and_record_leaves_no_duplicate_trace(tmp_path):
    run = _fill(tmp_path, n=2)
    run = RunDir(run.path, CONFIG)
    run.append_trace("p2", 0, [1], [1.0])  # killed here, before the record
    run.close()
    run = RunDir(run.path, CONFIG)  # resume: the orphan trace line goes
    run.append_trace("p2", 0, [1], [1.0])
    run.records.append(_rec(run, "p2", 0))
    keys = [(r["problem_id"], r["sample"]) for r in map(json.loads, (run.path / "trace.jsonl").read_text().splitlines())]
    assert keys == [("p0", 0), ("p1", 0), ("p2", 0)]


def test_record_of_another_configuration_is_refused(tmp_path):
    run = _fill(tmp_path)
    with open(run.path / "records.jsonl", "a") as f:
        f.write(json.dumps({"config_hash": "f" * 64, "problem_id": "p7", "sample": 0}) + "\n")
    with pytest.raises(RetentionError, match=r"records\.jsonl:4: record of another configuration"):
        RunDir(run.path, CONFIG)


def test_duplicated_record_is_refused(tmp_path):
    run = _fill(tmp_path)
    text = (run.path / "records.jsonl").read_text()
    (run.path / "records.jsonl").write_text(text + text.splitlines(keepends=True)[0])
    with pytest.raises(RetentionError, match="duplicated record"):
        RunDir(run.path, CONFIG)


def test_pending_pairs_are_lazy(tmp_path):
    """`run_arms` draws its (problem, sample) pairs from `shard_pairs` and counts what is left with
    `count_pending`: neither allocates per sample."""
    run = _fill(tmp_path, n=1)
    run = RunDir(run.path, CONFIG)
    arm = Arm(run, validate_arm({"model": "tiny-random", "scorer": "streaming", "budget": 16}))
    problems = [SimpleNamespace(unique_id=f"p{i}") for i in range(3)]
    huge = 10**20  # `--samples 99999999999999999999` must not allocate
    first = list(itertools.islice(shard_pairs(len(problems), huge, None), 3))
    assert first == [(0, 0), (0, 1), (0, 2)]
    assert count_pending([arm], problems, huge) == (3 * huge, 3 * huge - 1)


def test_another_configuration_shows_where_the_hashes_differ(tmp_path):
    """Two hashes equal in their first 10 characters: the message shows them long enough to differ."""
    run = _fill(tmp_path)
    ours = run.hash
    theirs = ours[:12] + ("0" if ours[12] != "0" else "1") + ours[13:]
    with open(run.path / "records.jsonl", "a") as f:
        f.write(json.dumps({"config_hash": theirs, "problem_id": "p7", "sample": 0}) + "\n")
    with pytest.raises(RetentionError) as err:
        RunDir(run.path, CONFIG)
    assert f"config_hash {theirs[:16]}, this run is {ours[:16]}" in str(err.value)


def test_records_are_graded_with_their_problem_text():
    """A multiple-choice gold (C) is matched by its option's content and never by the variable c: the
    record writer hands the grader the problem, whose options it reads."""
    from protocol.grading import grade
    from retention.runs.runner import make_record
    from retention.policy.cadence.base import Cadence
    from retention.runtime.meter import BudgetMeter

    problem = "Which shape is described by z = c? (A) Line (B) Circle (C) Plane (D) Sphere"

    def verdict(text):
        return make_record(config_hash="x", problem_id="p", sample=0, seed=0, prompt_tokens=1, token_ids=[1],
                           text=text, finish_reason="eos", meter=BudgetMeter(1.0), cadence=Cadence(None, 1),
                           wall_seconds=1.0, batch_size=1, gold="\\text{(C)}", grader=grade,
                           problem=problem)["verdict"]

    assert verdict("It is a plane: \\boxed{\\text{Plane}}") is True
    assert verdict("It is a line, so \\boxed{c}") is False
