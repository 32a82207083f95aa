"""A joint report of several confirm directories pairs arms within each plan's cells first and
never forms a cross-plan pair silently."""

from __future__ import annotations

from protocol import prereg, report
from tests.protocol.test_prereg import FakeRunner, new_plan, run_confirm

CELL = "qwen-1.5b@b256"


def _confirm(tmp_path, name, **over):
    path, h, _ = prereg.write_plan(new_plan(**over), tmp_path / f"plans-{name}")
    run_confirm(path, tmp_path / name, FakeRunner(), cells=[CELL])
    return h


def _pairs(rep):
    return sorted((r["plan_hash"], _scorer(r["treatment"]), _scorer(r["baseline"]),
                   r["confirmation"].split(";")[0]) for r in rep.comparisons)


def _scorer(label):
    return label.split("[")[0]


def test_two_plans_with_different_baselines_are_each_paired_within_their_plan(tmp_path):
    ha = _confirm(tmp_path, "a")
    hb = _confirm(tmp_path, "b", baseline={"scorer": "streaming", "accounting": "mean"})
    rep = report.build_report([tmp_path / "a" / "runs", tmp_path / "b" / "runs"])
    assert _pairs(rep) == sorted([(ha, "alpha", "triattention", "confirmed"),
                                  (hb, "alpha", "streaming", "confirmed")])
    assert not rep.provenance["unconfirmed"]


def test_a_superseding_plan_of_the_same_cell_is_paired_within_itself(tmp_path):
    ha = _confirm(tmp_path, "a")
    hb = _confirm(tmp_path, "b", seed=1, supersedes=[ha], reason="new grader")
    rep = report.build_report([tmp_path / "a" / "runs", tmp_path / "b" / "runs"])
    assert _pairs(rep) == sorted([(ha, "alpha", "triattention", "confirmed"),
                                  (hb, "alpha", "triattention", "confirmed")])
    for row in rep.comparisons:
        runs = {row["treatment_run"], row["baseline_run"]}
        assert all(r.plan_hash == row["plan_hash"] for r in map(report.load_run, _run_dirs(tmp_path))
                   if r.run_id in runs)


def test_runs_of_two_plans_without_sidecars_are_not_paired_across_plans(tmp_path):
    """Runs that lost their confirm.json sidecars still pair only within their plan: a plan with
    no baseline run left in the report is noted, never compared with another plan's."""
    ha = _confirm(tmp_path, "a")
    hb = _confirm(tmp_path, "b", baseline={"scorer": "streaming", "accounting": "mean"})
    for p in (tmp_path / "a").rglob("confirm.json"):
        p.unlink()
    dirs = [d for d in _run_dirs(tmp_path) if not (str(d).startswith(str(tmp_path / "b"))
                                                    and report.load_run(d).scorer == "streaming")]
    rep = report.build_report(dirs)
    assert [(r["plan_hash"], _scorer(r["treatment"]), _scorer(r["baseline"])) for r in rep.comparisons] == [
        (ha, "alpha", "triattention")]
    assert any(f"plan {hb[:12]}" in n and "cross-plan" in n for n in rep.notes)


def _run_dirs(tmp_path):
    return sorted(p.parent for p in tmp_path.rglob("records.jsonl"))
