"""`python -m protocol.grading.regrade`: committed records graded again with the current grader;
only the records whose grade changes are rewritten, and only with --write."""

from __future__ import annotations

import json

from protocol.grading import GRADER_VERSION
from protocol.grading.regrade import main, regrade_file

SHAPES_ID = "test/precalculus/819.json"
FALSE_POSITIVE = ("5. **Conclusion**: The direction vector of the line is \\(c\\).\n\n"
                  "Therefore, the direction vector of the line is \\(\\boxed{c}\\).")


def _run(tmp_path, records):
    run = tmp_path / "runs" / "arm-1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"config": {}}), encoding="utf-8")
    text = "".join(json.dumps(r, ensure_ascii=False, separators=(", ", ": ")) + "\n" for r in records)
    (run / "records.jsonl").write_text(text, encoding="utf-8")
    return run


def _records():
    # graded as the old grader did: the constant `c` credited against the option (C)
    return [
        {"problem_id": SHAPES_ID, "sample": 0, "text": FALSE_POSITIVE, "gold": "\\text{(C)}",
         "extracted": "c", "verdict": True, "reason": None, "rule": "boxed"},
        {"problem_id": "test/algebra/1.json", "sample": 0, "text": "So $\\boxed{4}$.", "gold": "4",
         "extracted": "4", "verdict": True, "reason": None, "rule": "boxed"},
        {"problem_id": "test/algebra/2.json", "sample": 0, "text": None, "gold": "4", "verdict": None},
    ]


def test_regrade_finds_and_writes_the_changed_verdict_only(tmp_path, capsys):
    run = _run(tmp_path, _records())
    before = (run / "records.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    assert main([str(tmp_path / "runs")]) == 0  # a dry run first
    out = capsys.readouterr().out
    assert f"arm-1 {SHAPES_ID} sample 0: True -> False (extracted 'c')" in out
    assert "1 changed verdicts, not written" in out
    assert (run / "records.jsonl").read_text(encoding="utf-8").splitlines(keepends=True) == before
    assert main([str(tmp_path / "runs"), "--write"]) == 0
    after = (run / "records.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    assert after[1:] == before[1:]                      # untouched lines stay byte for byte
    changed = json.loads(after[0])
    assert changed["verdict"] is False and changed["extracted"] == "c"
    # same fields, same order, and the version of the grader that gave the new verdict
    assert [k for k in changed if k != "grader_version"] == list(json.loads(before[0]))
    assert changed["grader_version"] == GRADER_VERSION
    assert main([str(tmp_path / "runs")]) == 0          # a second pass changes nothing
    assert "0 changed verdicts" in capsys.readouterr().out


def test_regrade_uses_the_problem_text_for_option_content(tmp_path):
    rec = {"problem_id": "p", "sample": 0, "text": "The shape is a $\\boxed{\\text{plane}}$.",
           "gold": "\\text{(C)}", "extracted": "\\text{plane}", "verdict": False, "reason": None,
           "rule": "boxed"}
    run = _run(tmp_path, [rec])
    problem = "Which shape?\n(A) Line\n(B) Circle\n(C) Plane\n(D) Sphere"
    changes = regrade_file(run / "records.jsonl", {"p": problem}, write=False)
    assert [(c.old, c.new) for c in changes] == [(False, True)]
    assert regrade_file(run / "records.jsonl", {}, write=False) == []  # no problem: no content


def test_regrade_bad_input_is_one_error_line(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    run = _run(tmp_path, _records())
    path = run / "records.jsonl"
    path.write_text(path.read_text(encoding="utf-8") + '{"problem_id": "x", "sam', encoding="utf-8")
    before = path.read_bytes()
    assert main([str(tmp_path / "runs"), "--write"]) == 2
    assert "half-written" in capsys.readouterr().err
    assert path.read_bytes() == before                  # nothing written
    path.write_bytes(before[:before.rindex(b"\n") + 1])  # repaired
    assert main([str(tmp_path / "runs"), "--timeout", "0", "--write"]) == 2
    assert "timeout must be a positive number" in capsys.readouterr().err
