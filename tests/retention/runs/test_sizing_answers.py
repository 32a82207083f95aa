"""`make run` keeps its accuracy signal (issue 48, item 5b): the sizing drops the fidelity proxy and
problems before it cuts answers below what the model's solved answers need, measured from records."""

from __future__ import annotations

import json

from retention.runs.sizing import (JobShape, Sizing, StepLine, fit_keeping_answers, fit_or_lighten,
                                   predicted_seconds, solved_tokens)

SHAPE = JobShape(tokens=768, batch=16, retention_arms=2, full_arms=1, fidelity=True, commands=2)
LINE, FILL = StepLine(0.05, 0.004), StepLine(0.3, 0.05)


def _fit(seconds, solved=320):
    return fit_keeping_answers(16, SHAPE, LINE, 10.0, seconds, 0.6, solved, prefill=FILL)


def test_answers_keep_their_length_before_the_fidelity_proxy_goes():
    # Enough time for 16 problems at 320 tokens without the proxy, not with it: the old rule kept the
    # proxy and cut the answers; the new one drops the proxy first.
    lean = JobShape(**{**SHAPE.__dict__, "fidelity": False})
    seconds = (predicted_seconds(16, JobShape(**{**lean.__dict__, "tokens": 320}), LINE, 10.0, FILL) + 1) / 0.6
    assert predicted_seconds(16, JobShape(**{**SHAPE.__dict__, "tokens": 320}), LINE, 10.0, FILL) > 0.6 * seconds
    old = fit_or_lighten(16, SHAPE, LINE, 10.0, seconds, 0.6, prefill=FILL)
    assert old[3] and old[1] < 320  # the old choice: the proxy kept, answers below the solved length
    n, tokens, t, fidelity = _fit(seconds)
    assert not fidelity and tokens >= 320 and t <= 0.6 * seconds and n == 16


def test_problems_go_before_answers_are_cut():
    lean = JobShape(**{**SHAPE.__dict__, "fidelity": False, "tokens": 320})
    seconds = (predicted_seconds(4, lean, LINE, 10.0, FILL) + 0.01) / 0.6
    n, tokens, t, fidelity = _fit(seconds)
    assert tokens >= 320 and 2 <= n < 16 and t <= 0.6 * seconds


def test_when_nothing_keeps_the_answers_the_old_rule_applies():
    seconds = 60.0
    assert _fit(seconds) == fit_or_lighten(16, SHAPE, LINE, 10.0, seconds, 0.6, prefill=FILL)


def test_plenty_of_time_changes_nothing():
    assert _fit(1e6)[:2] == (16, 768) and _fit(1e6)[3]


def test_solved_tokens_from_records(tmp_path):
    def runs(model, rows):
        d = tmp_path / f"{model}-alpha-b128-abc"
        d.mkdir(parents=True)
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    runs("m", [{"verdict": True, "output_tokens": n} for n in (100, 300, 200, 500)]
         + [{"verdict": False, "output_tokens": 2000}, {"verdict": None, "output_tokens": 3000}])
    runs("other", [{"verdict": True, "output_tokens": 5000}])
    assert solved_tokens(tmp_path, "m") == 256  # the median of 100, 200, 300, 500 (the 2nd: 200) -> 256
    assert solved_tokens(tmp_path, "m", 1.0) == 512
    assert solved_tokens(tmp_path, "nobody") is None


def test_the_note_says_whether_answers_were_kept():
    base = dict(requested=16, problems=16, requested_tokens=768, seconds_left=500, predicted_seconds=200,
                load_seconds=5, margin=0.6, shape=SHAPE.__dict__,
                steps={"step_ms": [10, 20], "slots": [1, 16], "prefill_ms": [5, 50]})
    assert "answers of at least 320 tokens kept" in Sizing(tokens=320, solved_tokens=320, **base).line()
    assert "no accuracy signal expected" in Sizing(tokens=128, solved_tokens=320, **base).line()
