"""One confirmation per cell *identity* across plans, the cell registry, runners in the record,
input errors refused before anything is written, and plans that can run (issue 18, items 5-7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol import ledger, prereg, report
from protocol.errors import ProtocolError
from tests.protocol.test_prereg import FakeRunner, _log, new_plan, run_confirm

CELL = "qwen-1.5b@b256"


def _key(plan, cid=CELL):
    cell = next(c for c in plan["cells"] if c["id"] == cid)
    return prereg.cell_key(prereg.cell_identity(plan, cell))


def _attempts(plan, cid=CELL):
    return ledger.Registry().cell_attempts(_key(plan, cid))


# --------------------------------------------------------------------------------------------------
# cell identity


def test_cell_identity_is_what_is_compared_not_how_it_is_run():
    base = new_plan()
    same = [new_plan(seed=1), new_plan(note="second look"), new_plan(k=8), new_plan(max_new_tokens=512),
            new_plan(boot=500, boot_max=500, alpha=0.01, m=9, boot_seed=3),
            new_plan(code_version="9.9"), new_plan(budgets=[256]),
            new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.5}, "accounting": "mean",
                                "device": "cuda", "dtype": "bfloat16", "limit": 100, "engine": "hf",
                                "fidelity": True, "temperature": 0.6},
                     baseline={"scorer": "triattention", "accounting": "mean", "limit": 100}),
            new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.5}}),  # mean: the default
            new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.5, "stats": "/a/b.safetensors"}})]
    for other in same:
        assert _key(other) == _key(base), other
    different = [new_plan(model_revisions={"qwen-1.5b": "abc"}),
                 new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.6}}),
                 new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.5}, "accounting": "peak"}),
                 new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.5}, "temperature": 0}),
                 new_plan(baseline={"scorer": "streaming"}),
                 new_plan(manifest_hash="cd" * 32), new_plan(dataset="aime24"),
                 prereg.with_cell_stats(base, {CELL: {"treatment": "1" * 64, "baseline": None}})]
    keys = {_key(p) for p in different}
    assert _key(base) not in keys and len(keys) == len(different)
    # budgets are separate cells; numbers compare by value (1 and 1.0 are one setting)
    assert _key(base, "qwen-1.5b@b512") != _key(base)
    assert _key(new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 1}})) == \
        _key(new_plan(treatment={"scorer": "alpha", "scorer_params": {"lambda": 1.0}}))
    ident = prereg.cell_identity(base, base["cells"][0])
    assert set(ident) == {"model", "model_revision", "budget", "accounting", "dataset", "split",
                          "split_manifest_sha256", "treatment", "baseline"}
    assert ident["dataset"] == "math500" and ident["accounting"] == {"baseline": "mean", "treatment": "mean"}


def test_dataset_is_stored_only_when_not_the_default():
    assert "dataset" not in new_plan()
    assert "dataset" not in prereg.arm_config(new_plan(), "0" * 64, new_plan()["cells"][0], "treatment")
    plan = new_plan(dataset="aime24")
    assert plan["dataset"] == "aime24"
    assert prereg.arm_config(plan, "0" * 64, plan["cells"][0], "baseline")["dataset"] == "aime24"
    with pytest.raises(ProtocolError, match="dataset"):
        new_plan(dataset="../x")


def test_arm_config_carries_each_cells_own_statistics():
    plan = prereg.with_cell_stats(new_plan(models=["m1", "m2"], budgets=[64]), {
        "m1@b64": {"treatment": "a" * 64, "baseline": "a" * 64},
        "m2@b64": {"treatment": "b" * 64, "baseline": None}})
    c1, c2 = plan["cells"]
    assert prereg.arm_config(plan, "0" * 64, c1, "treatment")["stats_sha256"] == "a" * 64
    assert prereg.arm_config(plan, "0" * 64, c2, "treatment")["stats_sha256"] == "b" * 64
    assert "stats_sha256" not in prereg.arm_config(plan, "0" * 64, c2, "baseline")


# --------------------------------------------------------------------------------------------------
# one confirmation per cell across plans


def _confirm_first(tmp_path):
    path, h, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    run_confirm(path, tmp_path / "a", FakeRunner(), cells=[CELL])
    return path, h


@pytest.mark.parametrize("over", [dict(seed=1), dict(note="another look"), dict(k=4), dict(boot=900)])
def test_same_cell_under_a_new_plan_is_refused_at_preregister(tmp_path, over):
    _, h = _confirm_first(tmp_path)
    with pytest.raises(ProtocolError, match=f"{CELL} was already confirmed under plan {h[:12]}"):
        prereg.write_plan(new_plan(**over), tmp_path / "plans2")
    assert not (tmp_path / "plans2").exists()
    # the open cell alone is a new plan nobody confirmed
    prereg.write_plan(new_plan(budgets=[512], **over), tmp_path / "plans3")


def test_superseding_plan_is_allowed_recorded_and_visible(tmp_path):
    path, h = _confirm_first(tmp_path)
    with pytest.raises(ProtocolError, match="needs both"):
        new_plan(seed=1, supersedes=[h])
    with pytest.raises(ProtocolError, match="no plan with that hash"):
        prereg.write_plan(new_plan(seed=1, supersedes=["e" * 12], reason="x"), tmp_path / "p")
    plan2 = new_plan(seed=1, supersedes=[h[:12]], reason="a bug in the grader fixed in 0.2")
    assert plan2["supersedes"] == {"plans": [h[:12]], "reason": "a bug in the grader fixed in 0.2"}
    path2, h2, _ = prereg.write_plan(plan2, tmp_path / "plans2")
    entry = run_confirm(path2, tmp_path / "b", FakeRunner(), cells=[CELL])[0]
    assert entry["supersedes"] == {"plans": [h], "reason": "a bug in the grader fixed in 0.2"}
    attempts = _attempts(plan2)
    assert attempts == _attempts(new_plan())  # the same cell, whatever the seed
    assert [(a["plan_hash"], a["status"], a["supersedes"], a["reason"]) for a in attempts] == [
        (h, "started", None, None), (h, "confirmed", None, None),
        (h2, "started", [h], "a bug in the grader fixed in 0.2"),
        (h2, "confirmed", [h], "a bug in the grader fixed in 0.2")]
    assert all(set(a) == set(ledger.ATTEMPT_FIELDS) for a in attempts)
    assert attempts[1]["out_dir"] == str((tmp_path / "a").resolve())
    # a third plan must name both earlier ones
    with pytest.raises(ProtocolError, match=f"confirmed under plan {h2[:12]}"):
        prereg.write_plan(new_plan(seed=2, supersedes=[h], reason="again"), tmp_path / "plans3")
    prereg.write_plan(new_plan(seed=2, supersedes=[h, h2], reason="again"), tmp_path / "plans3")


def test_confirm_refuses_a_repeat_registered_elsewhere(tmp_path, monkeypatch):
    """A plan registered in another registry (so preregister could not see the first plan) is
    refused by `confirm` in the registry that holds the first confirmation."""
    state = ledger.state_dir()
    _, h = _confirm_first(tmp_path)
    monkeypatch.setenv(ledger.STATE_ENV, str(tmp_path / "other-state"))
    path2, _, _ = prereg.write_plan(new_plan(seed=1), tmp_path / "plans2")
    monkeypatch.setenv(ledger.STATE_ENV, str(state))
    runner = FakeRunner()
    with pytest.raises(ProtocolError, match=f"already confirmed under plan {h[:12]}"):
        run_confirm(path2, tmp_path / "b", runner)
    assert runner.calls == [] and not (tmp_path / "b").exists()


def test_copied_plan_with_a_fresh_registry_is_not_detectable_by_design(tmp_path, monkeypatch):
    """The threat model (docs/walkthrough.md): a user who points RETENTION_STATE_DIR at an empty folder (or
    deletes the registry) can confirm again; only the same registry refuses."""
    state = ledger.state_dir()
    path, h = _confirm_first(tmp_path)
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(path, tmp_path / "b", FakeRunner(), cells=[CELL])
    monkeypatch.setenv(ledger.STATE_ENV, str(tmp_path / "fresh"))
    copy = tmp_path / "copy" / path.name
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert len(run_confirm(copy, tmp_path / "c", FakeRunner(), cells=[CELL])) == 1
    with pytest.raises(ProtocolError, match="already confirmed"):  # that registry now refuses too
        prereg.write_plan(new_plan(seed=1), tmp_path / "plans2")
    # ... and a plan re-registered with another seed in yet another empty registry confirms; the
    # original registry does not count its runs as confirmed (docs/walkthrough.md: "only detectable")
    monkeypatch.setenv(ledger.STATE_ENV, str(tmp_path / "fresh2"))
    path2, h2, _ = prereg.write_plan(new_plan(seed=1), tmp_path / "plans2")
    run_confirm(path2, tmp_path / "d", FakeRunner(), cells=[CELL])
    monkeypatch.setenv(ledger.STATE_ENV, str(state))
    rep = report.build_report([tmp_path / "d" / "runs"], boot=200)
    assert len(rep.provenance["unconfirmed"]) == 2
    assert all(f"plan {h2[:12]} is not in the registry" in why for why in rep.provenance["unconfirmed"].values())


def test_started_confirmation_is_recorded_and_blocks_another_plan(tmp_path):
    path, h, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    with pytest.raises(ProtocolError, match="crashed"):
        run_confirm(path, tmp_path / "a", FakeRunner(fail={(CELL, "treatment")}), cells=[CELL])
    plan = new_plan()
    assert [(a["plan_hash"], a["status"], a["out_dir"]) for a in _attempts(plan)] == [
        (h, "started", str((tmp_path / "a").resolve()))]
    assert _attempts(plan, "qwen-1.5b@b512") == []  # never touched
    with pytest.raises(ProtocolError, match=f"started, not finished, under plan {h[:12]}"):
        prereg.write_plan(new_plan(seed=3), tmp_path / "plans2")
    # the same plan resumes; the attempt is recorded once per (plan, cell, folder)
    run_confirm(path, tmp_path / "a", FakeRunner(), cells=[CELL])
    assert [a["status"] for a in _attempts(plan)] == ["started", "confirmed"]


def test_ledger_entry_names_identity_test_and_runner(tmp_path):
    path, h = _confirm_first(tmp_path)
    plan, _ = prereg.load_plan(path)
    entry = _log(ledger.ledger_path(tmp_path / "a"))[0]
    assert entry["cell_identity"] == prereg.cell_identity(plan, plan["cells"][0])
    assert entry["cell_key"] == _key(plan)
    assert entry["test"] == plan["test"]
    assert entry["runner"] == {"spec": "retention.runs.jobs:confirm_runner", "registered": True}


def test_unregistered_runner_is_recorded_and_a_deviation(tmp_path):
    path, _, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    entries = run_confirm(path, tmp_path / "a", FakeRunner(), runner_spec="my.mod:runner")
    assert all(e["runner"] == {"spec": "my.mod:runner", "registered": False} for e in entries)
    devs = _log(ledger.deviations_path(tmp_path / "a"))
    assert [(d["kind"], d["cell_id"], d["actual"]) for d in devs] == [
        ("runner", CELL, "my.mod:runner"), ("runner", "qwen-1.5b@b512", "my.mod:runner")]
    assert all(d["planned"] == "retention.runs.jobs:confirm_runner" for d in devs)
    assert all(e["deviations"] == [d["hash"]] for e, d in zip(entries, devs))
    # a plan that registers the runner: no deviation
    path2, _, _ = prereg.write_plan(new_plan(budgets=[1024], runner="my.mod:runner"), tmp_path / "plans")
    entry = run_confirm(path2, tmp_path / "b", FakeRunner(), runner_spec="my.mod:runner")[0]
    assert entry["runner"]["registered"] and entry["deviations"] == []
    with pytest.raises(ProtocolError, match="MODULE:FUNCTION"):
        new_plan(runner="not a spec")


def test_refused_confirm_leaves_no_folder(tmp_path):
    path, h = _confirm_first(tmp_path)
    out = tmp_path / "new" / "deeper"
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(path, out, FakeRunner(), cells=[CELL])
    assert not (tmp_path / "new").exists()
    with pytest.raises(ProtocolError, match="not an object"):  # an override that cannot apply
        run_confirm(path, out, FakeRunner(), overrides={"scorer.x": 1}, reason="r")
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------------------------------
# plans that can run


@pytest.mark.parametrize("arms,match", [
    (dict(treatment={"scorer": "alpha", "limit": 1}, baseline={"scorer": "triattention", "limit": 1}),
     "at least 2"),
    (dict(treatment={"scorer": "alpha", "limit": 10}, baseline={"scorer": "triattention"}), "not be paired"),
    (dict(treatment={"scorer": "alpha", "limit": 10}, baseline={"scorer": "triattention", "limit": 20}),
     "not be paired"),
    (dict(treatment={"scorer": "alpha", "limit": 0}, baseline={"scorer": "triattention", "limit": 0}),
     "positive integer"),
])
def test_plans_confirm_could_not_pair_are_refused(arms, match):
    with pytest.raises(ProtocolError, match=match):
        new_plan(**arms)


def test_limits_beyond_the_split_pair_up():
    # 299 confirm problems: a limit of 500 and no limit run the same problems
    new_plan(treatment={"scorer": "alpha", "limit": 500}, baseline={"scorer": "triattention"})
    new_plan(treatment={"scorer": "alpha", "limit": 2}, baseline={"scorer": "triattention", "limit": 2})
    with pytest.raises(ProtocolError, match="at least 2"):
        new_plan(treatment={"scorer": "alpha", "limit": 5}, baseline={"scorer": "triattention", "limit": 5},
                 dataset="tiny", n_confirm=1)


# --------------------------------------------------------------------------------------------------
# the registry file itself


def test_cell_registry_is_a_keyed_chain(tmp_path):
    _, h = _confirm_first(tmp_path)
    path = ledger.Registry().cell_path(_key(new_plan()))
    lines = path.read_text().splitlines()
    forged = json.loads(lines[1])
    forged["plan_hash"] = "f" * 64
    path.write_text(lines[0] + "\n" + json.dumps(forged) + "\n")
    with pytest.raises(ProtocolError, match="hash mismatch"):
        ledger.Registry().cell_attempts(_key(new_plan()))
    with pytest.raises(ProtocolError, match="not a cell key"):
        ledger.Registry().cell_attempts("../x")


# --------------------------------------------------------------------------------------------------
# CLI


def _cli(args):
    from retention.cli import main

    return CliRunner().invoke(main, args, catch_exceptions=False)


def _preregister(out, *extra):
    return _cli(["preregister", "--out", str(out), "--model", "tiny-random", "--budget", "256",
                 "--treatment", '{"scorer": "rkv"}', "--baseline-set", "scorer=streaming",
                 "-k", "2", "--max-new-tokens", "64", "--boot", "200", "--boot-max", "200",
                 "--code-version", "0.1.0+gtest", *extra])


def _one_error(res, *needles):
    assert res.exit_code != 0, res.output
    text = res.output.strip()
    assert text.startswith("Error:") and len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, text


def _confirm(plan, out, *extra):
    return _cli(["confirm", "--plan", str(plan), "--out", str(out), "--code-version", "0.1.0+gtest", *extra])


RUNNER = "tests.protocol.test_prereg:cli_runner"


def test_cli_repeat_with_seed_refused_then_superseded(tmp_path):
    assert _preregister(tmp_path / "p1").exit_code == 0
    plan1 = next((tmp_path / "p1").glob("plan-*.json"))
    _, h1 = prereg.load_plan(plan1)
    res = _confirm(plan1, tmp_path / "c1", "--runner", RUNNER)
    assert res.exit_code == 0, res.output
    _one_error(_preregister(tmp_path / "p2", "--seed", "1"), f"already confirmed under plan {h1[:12]}",
               "--supersedes")
    _one_error(_preregister(tmp_path / "p2", "--note", "x"), h1[:12])
    _one_error(_preregister(tmp_path / "p2", "--seed", "1", "--supersedes", h1[:12]), "reason")
    res = _preregister(tmp_path / "p2", "--seed", "1", "--supersedes", h1[:12], "--reason", "new grader")
    assert res.exit_code == 0, res.output
    assert f"supersedes {h1[:12]}: new grader" in res.output
    plan2, h2 = prereg.load_plan(next((tmp_path / "p2").glob("plan-*.json")))
    assert plan2["supersedes"] == {"plans": [h1[:12]], "reason": "new grader"}
    res = _confirm(next((tmp_path / "p2").glob("plan-*.json")), tmp_path / "c2", "--runner", RUNNER)
    assert res.exit_code == 0, res.output
    key = _log(ledger.ledger_path(tmp_path / "c2"))[0]["cell_key"]
    assert [(a["plan_hash"], a["status"]) for a in ledger.Registry().cell_attempts(key)] == [
        (h1, "started"), (h1, "confirmed"), (h2, "started"), (h2, "confirmed")]


def test_cli_runner_registered_or_recorded(tmp_path):
    res = _preregister(tmp_path / "p", "--runner", RUNNER)
    assert res.exit_code == 0, res.output
    plan_path = next((tmp_path / "p").glob("plan-*.json"))
    assert prereg.load_plan(plan_path)[0]["runner"] == RUNNER
    res = _confirm(plan_path, tmp_path / "c")  # no --runner: the plan's own
    assert res.exit_code == 0, res.output
    entry = _log(ledger.ledger_path(tmp_path / "c"))[0]
    assert entry["runner"] == {"spec": RUNNER, "registered": True} and entry["deviations"] == []
    # an unregistered runner runs, is recorded and is a deviation
    res = _preregister(tmp_path / "q")  # the same cell (the runner is not part of its identity)
    _one_error(res, "already confirmed")
    assert _preregister(tmp_path / "q", "--treatment-set", "temperature=0.5").exit_code == 0
    plan_q = next((tmp_path / "q").glob("plan-*.json"))
    res = _confirm(plan_q, tmp_path / "d", "--runner", RUNNER)
    assert res.exit_code == 0, res.output
    entry = _log(ledger.ledger_path(tmp_path / "d"))[0]
    assert entry["runner"] == {"spec": RUNNER, "registered": False}
    assert [d["kind"] for d in _log(ledger.deviations_path(tmp_path / "d"))] == ["runner"]
    _one_error(_preregister(tmp_path / "r", "--runner", "no.such.module:run"), "cannot load runner")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra,needle", [
    (["--override", "temprature=0.7", "--reason", "typo"], "unknown configuration key(s) ['temprature']"),
    (["--override", "scorer_params.nope=1", "--reason", "typo"], "no parameter(s) ['nope']"),
    (["--override", "temperature=hot", "--reason", "r"], "--temperature"),
    (["--override", "temperature"], "KEY=VALUE"),
    (["--runner", "no.such.module:run"], "cannot load runner"),
    (["--runner", "json:dumps"], "does not take (cell, arm, arm_config, out_dir)"),
    (["--runner", "json:nope"], "cannot load runner"),
    (["--runner", "json"], "MODULE:FUNCTION"),
])
def test_cli_input_errors_are_refused_before_anything_is_written(tmp_path, extra, needle):
    assert _preregister(tmp_path / "p").exit_code == 0
    plan_path = next((tmp_path / "p").glob("plan-*.json"))
    out = tmp_path / "c"
    _one_error(_confirm(plan_path, out, *(["--runner", RUNNER] if "--runner" not in extra else []), *extra),
               needle)
    assert not out.exists()  # no folder, no .confirm.lock, no crash deviation
    assert list((tmp_path / "p").iterdir()) == [plan_path]  # no ledger beside the plan either
    # the plan is intact and confirms normally afterwards
    res = _confirm(plan_path, out, "--runner", RUNNER)
    assert res.exit_code == 0, res.output
    assert [d["kind"] for d in _log(ledger.deviations_path(out))] == ["runner"]


def test_cli_refused_confirm_leaves_no_lock_folder(tmp_path):
    assert _preregister(tmp_path / "p").exit_code == 0
    plan_path = next((tmp_path / "p").glob("plan-*.json"))
    assert _confirm(plan_path, tmp_path / "c", "--runner", RUNNER).exit_code == 0
    _one_error(_confirm(plan_path, tmp_path / "again", "--runner", RUNNER), "already confirmed")
    assert not (tmp_path / "again").exists()


def test_cli_confirm_shard_checks_the_manifest_of_splits_dir(tmp_path, monkeypatch):
    """`confirm --shard` verifies the plan's split manifest against --splits-dir's, as the
    unsharded confirm does (it used to check the default splits whatever --splits-dir said)."""
    import shutil

    import retention.runs.jobs as jobs

    calls = []
    monkeypatch.setattr(jobs, "confirm_runner", lambda *a, **kw: calls.append(a))
    assert _preregister(tmp_path / "p").exit_code == 0
    plan_path = next((tmp_path / "p").glob("plan-*.json"))
    other = tmp_path / "splits"
    shutil.copytree(Path(__file__).resolve().parents[2] / "splits", other)
    manifest = other / "math500" / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")  # the same lists (it verifies), other bytes
    _one_error(_confirm(plan_path, tmp_path / "c", "--shard", "0/2", "--splits-dir", str(other)),
               "split manifest", "differs from the registered")
    assert calls == [] and not (tmp_path / "c").exists()


def test_cli_limit_one_refused_at_preregister(tmp_path):
    _one_error(_preregister(tmp_path / "p", "--treatment-set", "limit=1", "--baseline-set", "limit=1"),
               "at least 2")
    _one_error(_preregister(tmp_path / "p", "--treatment-set", "limit=5"), "not be paired")
    assert not (tmp_path / "p").exists()


def test_cli_confirm_shard_records_started(tmp_path, monkeypatch):
    import retention.runs.jobs as jobs

    calls = []

    def shard_runner(cell, arm, cfg, out_dir, *, shard=None, splits_dir=None, trace=False):
        calls.append((cell["id"], arm, shard))
        d = Path(out_dir) / arm
        d.mkdir(parents=True, exist_ok=True)
        return d

    monkeypatch.setattr(jobs, "confirm_runner", shard_runner)
    assert _preregister(tmp_path / "p").exit_code == 0
    plan_path = next((tmp_path / "p").glob("plan-*.json"))
    plan, h = prereg.load_plan(plan_path)
    res = _confirm(plan_path, tmp_path / "c", "--shard", "0/2")
    assert res.exit_code == 0, res.output
    assert [(c, a) for c, a, _ in calls] == [("tiny-random@b256", "baseline"), ("tiny-random@b256", "treatment")]
    attempts = ledger.Registry().cell_attempts(prereg.cell_key(prereg.cell_identity(plan, plan["cells"][0])))
    assert [(a["plan_hash"], a["status"], a["out_dir"]) for a in attempts] == [
        (h, "started", str((tmp_path / "c").resolve()))]
    res = _confirm(plan_path, tmp_path / "c", "--shard", "1/2")  # the second shard: recorded once
    assert res.exit_code == 0, res.output
    assert len(ledger.Registry().cell_attempts(attempts and prereg.cell_key(
        prereg.cell_identity(plan, plan["cells"][0])))) == 1
    # the abandoned shard blocks another plan on the same cell
    _one_error(_preregister(tmp_path / "p2", "--seed", "7"), f"started, not finished, under plan {h[:12]}")
    # input errors in a shard are refused before anything is written
    _one_error(_confirm(plan_path, tmp_path / "s", "--shard", "0/2", "--override", "nope=1", "--reason", "r"),
               "unknown configuration key")
    _one_error(_confirm(plan_path, tmp_path / "s", "--shard", "0/2", "--runner", RUNNER), "--shard")
    _one_error(_confirm(plan_path, tmp_path / "s", "--shard", "0/2", "--override", "split=dev", "--reason", "r"),
               "cannot override")
    assert not (tmp_path / "s").exists()


# --------------------------------------------------------------------------------------------------
# two models, each with its own calibration statistics


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """tiny-random and a saved copy of it, each calibrated on its own text (different files)."""
    import torch

    from retention.policy.scoring.calibration import calibrate, default_stats_path
    from retention.models import load_model

    root = tmp_path_factory.mktemp("two")
    tiny = load_model("tiny-random", dtype="float32", device="cpu")
    other = root / "tiny-b"
    tiny.model.save_pretrained(other)
    tiny.tokenizer.save_pretrained(other)
    mp = pytest.MonkeyPatch()
    mp.setenv("RETENTION_CACHE_DIR", str(root / "cache"))
    for name, seed in (("tiny-random", 0), (str(other), 1)):
        ids = torch.randint(0, 200, (120,), generator=torch.Generator().manual_seed(seed))
        path = default_stats_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        calibrate(tiny.model, ids).save(path)
    mp.undo()
    return root, other


def test_two_model_plan_records_each_cells_statistics(two_models, tmp_path, monkeypatch):
    import hashlib

    from retention.policy.scoring.calibration import default_stats_path

    root, other = two_models
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(root / "cache"))
    res = _cli(["preregister", "--out", str(tmp_path / "p"), "--model", "tiny-random", "--model", str(other),
                "--budget", "64", "--budget", "128", "--treatment-set", "scorer=alpha",
                "--treatment-set", "scorer_params.lambda=0.5", "--baseline-set", "scorer=triattention",
                "-k", "2", "--max-new-tokens", "16", "--code-version", "0.1.0+gtest"])
    assert res.exit_code == 0, res.output
    plan_path = next((tmp_path / "p").glob("plan-*.json"))
    plan, h = prereg.load_plan(plan_path)
    sha = {m: hashlib.sha256(default_stats_path(m).read_bytes()).hexdigest() for m in ("tiny-random", str(other))}
    assert sha["tiny-random"] != sha[str(other)]
    for cell in plan["cells"]:
        assert cell["stats_sha256"] == {"treatment": sha[cell["model"]], "baseline": sha[cell["model"]]}
        assert prereg.arm_config(plan, h, cell, "treatment")["stats_sha256"] == sha[cell["model"]]
    assert len({_key(plan, c["id"]) for c in plan["cells"]}) == 4
    # statistics changed after registration: confirm refuses before anything runs or is written
    default_stats_path(str(other)).write_bytes(default_stats_path("tiny-random").read_bytes())
    _one_error(_confirm(plan_path, tmp_path / "c", "--runner", RUNNER), "changed since registration")
    assert not (tmp_path / "c").exists()
    assert all(ledger.Registry().cell_attempts(_key(plan, c["id"])) == [] for c in plan["cells"])


def _append_attempts(args):
    root, key, tag = args
    reg = ledger.Registry(Path(root))
    for i in range(15):
        reg.record_attempt(key, plan_hash=f"{tag}{i:02d}".ljust(64, "0"), cell_id="c", status="started",
                           out_dir=f"/out/{tag}")
        reg.cell_attempts(key)


def test_concurrent_writers_keep_the_cell_chain_valid(tmp_path):
    """Shards of a confirmation record their start at once: the chain stays whole."""
    import multiprocessing

    key = "a" * 64
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        pool.map(_append_attempts, [(str(tmp_path), key, t) for t in ("1", "2", "3")])
    attempts = ledger.Registry(tmp_path).cell_attempts(key)
    assert len(attempts) == 45 and len({a["plan_hash"] for a in attempts}) == 45
