"""The sceptic's diagnostics of an arm, recomputed independently on synthetic records, and shown in the
report (terminal lines, diagnostics.csv)."""

import pytest

from protocol import report
from protocol.diagnostics import first_compaction_step, is_looping, sceptic_diagnostics, small_gold
from protocol.render import terminal_summary
from protocol.runs import Run
from tests.protocol.test_report import make_run


def rec(pid, sample, verdict, gold, out=100, finish="eos", compactions=0, prompt=50, ids=None, **kw):
    return {"problem_id": pid, "sample": sample, "verdict": verdict, "gold": gold, "output_tokens": out,
            "finish_reason": finish, "compactions": compactions, "prompt_tokens": prompt,
            "output_token_ids": ids if ids is not None else list(range(out)), **kw}


LOOP = list(range(40)) + [7, 8, 9] * 80  # 280 tokens whose last 192 repeat with period 3


def run_of(records, **config):
    return Run(path=None, meta={"run_id": "r"}, config={"split": "dev", "nominal_b": 100, "interval": 20,
                                                        **config}, records=records, label="arm")


RECORDS = [
    rec("p1", 0, True, "3", out=200, compactions=2, prompt=50),            # first compaction at 70
    rec("p1", 1, True, "3", out=280, finish="length", compactions=3, prompt=50, ids=LOOP),
    rec("p2", 0, False, "\\frac{1}{2}", out=60, compactions=0, prompt=50),
    rec("p3", 0, True, " $12$ ", out=150, compactions=1, prompt=130),      # prompt > b: at prefill
    rec("p4", 0, False, "0", out=300, finish="length", compactions=4, prompt=40,
        prompt_evicted_step=12, prompt_held_final=0.5),
    rec("p4", 1, True, "0", out=90, compactions=0, prompt=40, prompt_evicted_step=None, prompt_held_final=None),
]


def test_pieces():
    assert is_looping(LOOP) and not is_looping(list(range(300))) and not is_looping([1] * 100)
    assert is_looping("ab" * 100) and not is_looping("the answer is 4")
    assert [small_gold(g) for g in ("3", " $0$ ", "7", "12", "-1", None, "\\frac{1}{2}")] == \
        [True, True, False, False, False, False, False]
    run = run_of(RECORDS)
    assert [first_compaction_step(run, r, None) for r in RECORDS] == [70, 70, None, 0, 80, None]
    on_top = run_of(RECORDS, protect_prompt=True)
    assert first_compaction_step(on_top, RECORDS[3], None) == 120
    assert first_compaction_step(run, RECORDS[0], {"compactions": [{"step": 33}]}) == 33
    assert first_compaction_step(run_of(RECORDS, cadence="newline"), RECORDS[0], None) is None


def test_every_figure_recomputed():
    d = sceptic_diagnostics(run_of(RECORDS))
    assert d["records"] == 6 and d["accuracy"] == pytest.approx(4 / 6)
    assert d["acc_strict"] == pytest.approx(3 / 6)  # p1/1 is correct but ran to the limit
    assert d["truncated_share"] == pytest.approx(2 / 6) and d["looping_share"] == pytest.approx(1 / 6)
    assert d["compacted_share"] == pytest.approx(4 / 6)
    after = [(200 - 70) / 200, (280 - 70) / 280, 0, 1.0, (300 - 80) / 300, 0]
    assert d["after_compaction_share"] == pytest.approx(sum(after) / 6)
    # correct: p1/0 (3), p1/1 (3), p3 (12), p4/1 (0): three of four have a gold 0..6
    assert d["small_gold_correct_share"] == pytest.approx(3 / 4)
    assert d["small_gold_problem_share"] == pytest.approx(2 / 4)  # p1 and p4 of p1..p4
    assert d["prompt"] == "evict" and d["prompt_evicted_share"] == pytest.approx(1 / 2)
    assert d["prompt_held_final"] == pytest.approx(0.5)


def test_unknown_steps_and_missing_fields_are_none():
    d = sceptic_diagnostics(run_of(RECORDS, cadence="newline"))
    assert d["after_compaction_share"] is None
    bare = [{"problem_id": "p", "sample": 0, "verdict": False, "gold": "9"}]
    d = sceptic_diagnostics(run_of(bare))
    assert d["compacted_share"] is None and d["small_gold_correct_share"] is None
    assert d["prompt_evicted_share"] is None and d["prompt_held_final"] is None


def test_in_the_report(tmp_path):
    make_run(tmp_path / "runs", scorer="triattention", seed=1)
    make_run(tmp_path / "runs", scorer="alpha", seed=2, shift=0.05)
    rep = report.build_report([tmp_path / "runs"], boot=300, seed=1)
    assert {r["label"] for r in rep.sceptic} == {a["label"] for a in rep.arms}
    by_label = {r.label: r for r in rep.runs}
    for row in rep.sceptic:
        recs = by_label[row["label"]].records
        strict = sum(r["verdict"] is True and r["finish_reason"] != "length" for r in recs) / len(recs)
        assert row["acc_strict"] == pytest.approx(strict)
    assert sum(line.startswith("diagnostics ") for line in terminal_summary(rep).splitlines()) == len(rep.arms)
    written = report.write_report(rep, tmp_path / "out")
    assert any(str(p).endswith("diagnostics.csv") for p in written)
