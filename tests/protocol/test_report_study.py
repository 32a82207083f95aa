"""Reports at the study's real shape (issue 18): two models with their own statistics, registered
tests, runs counted once, foreign records, repeated confirmations and runners, and the findings
about messages, file counts, stderr and figures."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from protocol import ledger, prereg, report, report_figures
from protocol.errors import ProtocolError
from tests.protocol.test_prereg import FakeRunner, new_plan, run_confirm
from tests.protocol.test_report import _records, _write_records, make_run
from tests.cli import invoke as _cli

ROOT = Path(__file__).resolve().parents[2]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _study(root, *, stats_as="hash", models=("qwen-1.5b", "r1-distill-qwen-7b"), budgets=(64, 128), n=30):
    """Two models x two budgets, triattention and alpha, each model with its own statistics."""
    seed = 0
    for model in models:
        digest = _sha(f"statistics of {model}")
        stats = f"sha256:{digest}" if stats_as == "hash" else f"/cache/{model}/stats.safetensors"
        for budget in budgets:
            for scorer, shift, params in (("triattention", 0.0, {}), ("alpha", 0.1, {"lam": 0.5})):
                seed += 1
                make_run(root, model=model, scorer=scorer, budget=budget, n=n, seed=seed, shift=shift,
                         params={**params, "stats": stats}, extra={"stats_sha256": digest})


# --------------------------------------------------------------------------------------------------
# item 2: labels and baseline matching never use paths


@pytest.mark.parametrize("stats_as", ["hash", "path"])
def test_two_models_with_their_own_statistics_pair_in_every_cell(tmp_path, stats_as):
    _study(tmp_path, stats_as=stats_as)
    for baseline in (None, "triattention"):
        rep = report.build_report([tmp_path], boot=300, baseline=baseline)
        assert [(r["model"], r["budget"]) for r in rep.comparisons] == [
            ("qwen-1.5b", 64), ("qwen-1.5b", 128), ("r1-distill-qwen-7b", 64), ("r1-distill-qwen-7b", 128)]
        assert {(r["treatment"], r["baseline"]) for r in rep.comparisons} == {("alpha", "triattention")}
        assert {r["m"] for r in rep.comparisons} == {4} and rep.settings["m"] == 4
        assert not [n for n in rep.notes if "not compared" in n]
        assert not any("/" in a["label"] or "stats" in a["label"] for a in rep.arms)


def test_the_same_arm_with_other_statistics_in_one_cell_gets_a_short_hash(tmp_path):
    a = make_run(tmp_path, scorer="triattention", n=10, params={"stats": "sha256:" + "a" * 64},
                 extra={"stats_sha256": "a" * 64})
    make_run(tmp_path, scorer="triattention", n=10, seed=2, params={"stats": "sha256:" + "b" * 64},
             extra={"stats_sha256": "b" * 64})
    rep = report.build_report([tmp_path], boot=200, baseline=str(a))
    assert [(r["treatment"], r["baseline"]) for r in rep.comparisons] == [
        ("triattention[stats=bbbbbbbb]", "triattention[stats=aaaaaaaa]")]


# --------------------------------------------------------------------------------------------------
# item 4: runs counted once, foreign records refused


def test_a_run_and_its_copy_are_refused_naming_both_paths(tmp_path):
    t = make_run(tmp_path / "runs", scorer="alpha", n=10)
    make_run(tmp_path / "runs", scorer="triattention", n=10, seed=1)
    copy = tmp_path / "merged" / t.name
    shutil.copytree(t, copy)
    with pytest.raises(ProtocolError, match="given twice") as err:
        report.build_report([tmp_path / "runs", copy], boot=200)
    assert str(t.resolve()) in str(err.value) and str(copy.resolve()) in str(err.value)
    # the same directory given twice (itself and inside its folder) is one run: m stays 1
    rep = report.build_report([tmp_path / "runs", t, t], boot=200)
    assert len(rep.comparisons) == 1 and rep.comparisons[0]["m"] == 1


def test_a_shard_and_its_merge_are_refused(tmp_path):
    t = make_run(tmp_path / "runs", scorer="alpha", n=10)
    make_run(tmp_path / "runs", scorer="triattention", n=10, seed=1)
    shard = tmp_path / "shard0" / t.name
    shard.mkdir(parents=True)
    shutil.copy(t / "config.json", shard / "config.json")
    (shard / "records.shard-0-of-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(t)[::2]))
    res = _cli("report", tmp_path / "runs", tmp_path / "shard0", "--out", tmp_path / "rep", "--boot", 200)
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "given twice" in res.output


def test_a_record_of_another_configuration_is_refused_with_its_line(tmp_path):
    t = make_run(tmp_path, scorer="alpha", n=5, k=1)
    make_run(tmp_path, scorer="triattention", n=5, k=1, seed=1)
    recs = _records(t)
    own = recs[0]["config_hash"]
    recs[2]["config_hash"] = own[:12] + ("0" if own[12] != "0" else "1") + own[13:]  # differs at char 12
    _write_records(t, recs)
    with pytest.raises(ProtocolError, match=r"records.jsonl:3: record of another configuration") as err:
        report.build_report([tmp_path], boot=200)
    theirs, ours = str(err.value).split("(")[1].split(")")[0].split(", this run is ")
    assert theirs != ours  # the differing part is shown
    del recs[2]["config_hash"]
    _write_records(t, recs)
    with pytest.raises(ProtocolError, match="records.jsonl:3: record of another configuration"):
        report.load_run(t)


# --------------------------------------------------------------------------------------------------
# item 3: the registered test


@pytest.fixture
def confirmed(tmp_path):
    """A plan registered with alpha 0.01, B 300, boot seed 7, m 3, confirmed on both cells."""
    plan = new_plan(alpha=0.01, boot=300, boot_max=300, boot_seed=7, m=3)
    path, h, _ = prereg.write_plan(plan, tmp_path / "plans")
    out = tmp_path / "confirm"
    run_confirm(path, out, FakeRunner())
    return out, h


def test_a_confirmed_cell_is_reported_with_its_registered_test(confirmed, tmp_path):
    out, h = confirmed
    rep = report.build_report([out / "runs"])
    assert len(rep.comparisons) == 2
    for row in rep.comparisons:
        assert (row["alpha"], row["boot_requested"], row["boot_max"], row["seed"], row["m"]) == (0.01, 300, 300, 7, 3)
        assert row["test_source"] == f"registered (plan {h[:12]})" and row["confirmation"] == "confirmed"
        assert row["p_bonferroni"] == pytest.approx(min(1.0, 3 * row["p_bootstrap"]))
    reg = rep.provenance["registered_tests"][h]
    assert (reg["alpha"], reg["boot"], reg["seed"], reg["m"]) == (0.01, 300, 7, 3)
    text = report.terminal_summary(rep)
    assert (f"registered (plan {h[:12]}): cluster bootstrap B=300 (max 300) seed=7, "
            "Bonferroni over m=3 at alpha=0.01") in text
    assert "\\alpha=0.01" in report.to_latex(rep) and "B=300" in report.to_latex(rep)
    # the command line may repeat a registered value, never change it
    assert report.build_report([out / "runs"], alpha=0.01, boot=300, m=3).comparisons[0]["alpha"] == 0.01
    for kw, line in (({"alpha": 0.9}, "--alpha 0.9 differs from the registered alpha 0.01"),
                     ({"boot": 100}, "--boot 100 differs from the registered boot 300"),
                     ({"seed": 0}, "--boot-seed 0 differs from the registered seed 7"),
                     ({"m": 1}, "--m 1 differs from the registered m 3")):
        with pytest.raises(ProtocolError, match=line):
            report.build_report([out / "runs"], **kw)
    res = _cli("report", out / "runs", "--out", tmp_path / "rep", "--alpha", "0.9")
    assert res.exit_code == 1 and res.output.strip().splitlines() == [
        f"Error: --alpha 0.9 differs from the registered alpha 0.01 of plan {h[:12]} (cell qwen-1.5b@b256): "
        "a confirmed cell is reported with its registered test; drop --alpha"]
    assert not (tmp_path / "rep").exists()
    res = _cli("report", out / "runs", "--out", tmp_path / "rep")
    assert res.exit_code == 0, res.output
    csv = (tmp_path / "rep" / "report.csv").read_text()
    assert "test_source" in csv.splitlines()[0] and f"registered (plan {h[:12]})" in csv
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["provenance"]["registered_tests"][h]["alpha"] == 0.01


def test_older_ledger_entries_fall_back_to_their_result(confirmed, monkeypatch):
    from protocol import provenance

    out, h = confirmed
    real = provenance.read_confirmation

    def without_test(d, registry=None):
        conf = real(d, registry)
        for cell in conf["cells"]:
            cell.pop("test", None)
        return conf

    monkeypatch.setattr(provenance, "read_confirmation", without_test)
    row = report.build_report([out / "runs"]).comparisons[0]
    assert (row["alpha"], row["boot_requested"], row["seed"], row["m"]) == (0.01, 300, 7, 3)


# --------------------------------------------------------------------------------------------------
# items 5/6: repeated and unfinished confirmations, unregistered runners


class FakeRegistry(ledger.Registry):
    """The user's registry plus the attempts per cell identity the prereg side records."""

    def __init__(self, attempts):
        super().__init__()
        self.attempts = attempts

    def cell_attempts(self, cell_key):
        return self.attempts.get(cell_key, [])


def _with_cell_fields(monkeypatch, runner=None, fake_keys=True):
    """Ledger cells with a cell_key (`fake_keys`: one a fake registry knows) and a runner when
    given. Returns the unpatched reader."""
    from protocol import provenance

    real = provenance.read_confirmation

    def patched(d, registry=None):
        conf = real(d, registry)
        for cell in conf["cells"]:
            if fake_keys:
                cell["cell_key"] = _sha(cell["cell_id"])
            if runner is not None:
                cell["runner"] = runner
        return conf

    monkeypatch.setattr(provenance, "read_confirmation", patched)
    return real


def test_cells_confirmed_more_than_once_and_started_attempts_are_shown(confirmed, monkeypatch):
    from protocol import provenance

    out, h = confirmed
    real = _with_cell_fields(monkeypatch)
    key = _sha("qwen-1.5b@b256")
    def attempt(plan, status, day, supersedes=None, reason=None):
        return {"plan_hash": plan, "cell_id": "qwen-1.5b@b256", "status": status,
                "at": f"2026-12-0{day}T10:00:00+00:00",
                "out_dir": f"/out/{plan[:4]}", "supersedes": supersedes, "reason": reason}

    # as the registry records them: "started" before generating, "confirmed" when committed
    attempts = {key: [attempt("1" * 64, "started", 1), attempt("1" * 64, "confirmed", 1),
                      attempt(h, "started", 2, ["1" * 64], "new code"),
                      attempt(h, "confirmed", 2, ["1" * 64], "new code"),
                      attempt("2" * 64, "started", 3, [h], "again")],
                # the other cell's record, as confirm wrote it (none: the report reads UNCONFIRMED)
                _sha("qwen-1.5b@b512"): [dict(attempt(h, s, 2), cell_id="qwen-1.5b@b512")
                                         for s in ("started", "confirmed")]}
    rep = report.build_report([out / "runs"], registry=FakeRegistry(attempts))
    rows = {r["budget"]: r for r in rep.comparisons}
    assert rows[512]["confirmation"] == "confirmed"
    text = rows[256]["confirmation"]
    assert "REPEATED: confirmed 2 times" in text and "no reason given" in text and "reason 'new code'" in text
    assert "1 attempt(s) started, not finished (plan 222222222222" in text and "reason 'again'" in text
    assert "REPEATED" in report.terminal_summary(rep)
    assert rep.provenance["cell_attempts"][key] == attempts[key]
    # the registry confirm really wrote: one confirmation per cell
    monkeypatch.setattr(provenance, "read_confirmation", real)
    assert report.build_report([out / "runs"]).comparisons[0]["confirmation"] == "confirmed"


def test_an_unregistered_runner_is_a_deviation_never_plainly_confirmed(confirmed, monkeypatch):
    out, h = confirmed
    _with_cell_fields(monkeypatch, runner={"spec": "evil:flip", "registered": False}, fake_keys=False)
    rep = report.build_report([out / "runs"])
    kinds = [d["kind"] for d in rep.provenance["deviations"]]
    assert kinds.count("runner") == 2  # one per cell, synthesized when the log lacks it
    for row in rep.comparisons:
        assert row["confirmation"].startswith("DEVIATION: runner evil:flip not registered")
        assert row["verdict"].startswith("DEVIATION (")
    text = report.terminal_summary(rep)
    assert f"plan: {h[:12]}; 2 deviation(s) logged" in text and "runner evil:flip" in text
    assert "DEVIATION" in report.to_latex(rep)


# --------------------------------------------------------------------------------------------------
# item 8: the report's findings


def test_dev_and_confirm_runs_are_different_splits_not_unpaired(tmp_path):
    t = make_run(tmp_path, scorer="alpha", n=10, split="dev")
    b = make_run(tmp_path, scorer="triattention", n=10, seed=1, split="confirm")
    with pytest.raises(ProtocolError, match="different splits"):
        report.pair_runs(report.load_run(t), report.load_run(b))
    with pytest.raises(ProtocolError, match="split confirm: different splits"):
        report.build_report([tmp_path], boot=200)


def test_an_unreadable_line_is_named_once(tmp_path):
    from protocol.data import read_json_objects  # MATH JSONL, read with read_jsonl's default wording

    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{broken\n{"b": 2}\n')
    with pytest.raises(ProtocolError) as err:
        read_json_objects(path)
    assert ":2:" in str(err.value) and "line line" not in str(err.value)


def test_stats_prints_plain_values(tmp_path):
    (tmp_path / "d.csv").write_text("p,t,b\n0,1,0\n0,1,1\n1,0,0\n")
    res = _cli("stats", tmp_path / "d.csv", "--treatment", "t", "--baseline", "b", "--cluster", "p")
    assert res.exit_code == 1 and "problem '1' has 1" in res.output and "np." not in res.output


def test_report_confirm_dir_that_is_not_one_fails_in_one_line(tmp_path):
    make_run(tmp_path / "runs", scorer="alpha", n=5)
    make_run(tmp_path / "runs", scorer="triattention", n=5, seed=1)
    for bad in (tmp_path / "nonexistent", tmp_path / "runs"):
        res = _cli("report", tmp_path / "runs", "--confirm-dir", bad, "--out", tmp_path / "rep")
        assert res.exit_code == 1 and res.output.count("\n") == 1 and res.output.startswith("Error: --confirm-dir")
    assert not (tmp_path / "rep").exists()


def _report_subprocess(*args):
    return subprocess.run([sys.executable, "-m", "retention.cli", "report", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_report_counts_what_it_writes_and_keeps_stderr_clean(tmp_path):
    for i, scorer in enumerate(("triattention", "alpha", "h2o")):
        make_run(tmp_path / "runs", scorer=scorer, n=30, seed=i, trace=True, fidelity=0.1 * (i + 1),
                 params={"lam": 0.5, "a_long_parameter_name": "a-long-value-" * 3} if scorer == "alpha" else None)
    res = _report_subprocess(tmp_path / "runs", "--out", tmp_path / "rep", "--boot", 200)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    files = sorted(p.name for p in (tmp_path / "rep").iterdir())
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith(f"wrote {len(files)} file(s)")
    assert sorted(line.split(": ", 1)[1].split(", ")) == files
    assert json.loads((tmp_path / "rep" / report.REPORT_LISTING).read_text())["files"] == [
        f for f in files if f != report.REPORT_LISTING]
    bad = _report_subprocess(tmp_path / "runs", "--out", tmp_path / "rep", "--alpha", "0")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("Error:")


def test_proxy_figure_stays_readable_with_many_arms():
    """16 arms with long labels: no layout warning (axes collapsed to slivers before), the legend
    below the panels grows the figure instead of squeezing the axes, nothing reaches stderr."""
    import matplotlib.image as mpimg
    import io

    rows = [{"label": f"alpha[lam={lam},stats=/root/.cache/retention/stats/{model}/calibration.safetensors]",
             "model": model, "budget": budget, "accounting": "mean", "accuracy": 0.3 + lam / 10 + budget / 1000,
             "kl_mean": 0.3 - lam / 20, "top1_agreement": 0.7 + lam / 20, "fidelity_records": 10}
            for model in ("qwen-1.5b", "r1-distill-qwen-7b") for lam in (0.1, 0.25, 0.5, 0.75, 1, 2, 4, 8)
            for budget in (64, 128)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        png = report_figures.proxy_vs_accuracy(rows)
    assert [str(w.message) for w in caught] == []
    few = report_figures.proxy_vs_accuracy(rows[:4])
    big, small = (mpimg.imread(io.BytesIO(p)) for p in (png, few))
    assert big.shape[1] == small.shape[1] and big.shape[0] > small.shape[0]  # taller, never narrower axes


def test_figure_warnings_become_report_notes(monkeypatch):
    def noisy(rows):
        warnings.warn("layout trouble")
        return b"png"

    monkeypatch.setattr(report_figures, "accuracy_vs_cache", noisy)
    rep = type("R", (), {"arms": [], "traces": {}, "subsets": [], "proxy": []})()
    figures, notes = report_figures.render_all(rep)
    assert figures == {"accuracy_vs_cache.png": b"png"} and notes == ["accuracy_vs_cache.png: layout trouble"]


def test_confirm_runs_compared_otherwise_than_registered_are_not_confirmed(confirmed):
    out, _ = confirmed
    rep = report.build_report([out / "runs"], baseline="alpha", boot=300)  # arms swapped
    for row in rep.comparisons:
        assert row["treatment"] == "triattention" and row["test_source"] == "report settings"
        assert row["confirmation"] == "UNCONFIRMED: not a registered comparison of a confirmed cell"
        assert row["verdict"].startswith("UNCONFIRMED (")


def test_an_old_run_with_only_a_statistics_path_never_shows_it(tmp_path):
    for i, stats in enumerate(("/cache/a/stats.safetensors", "/cache/b/stats.safetensors")):
        make_run(tmp_path, scorer="triattention", n=8, seed=i, params={"stats": stats})
    rep = report.build_report([tmp_path], boot=200)
    assert all("/" not in a["label"] and "cache" not in a["label"] for a in rep.arms)
    assert len({a["label"] for a in rep.arms}) == 2  # told apart by configuration hash instead
