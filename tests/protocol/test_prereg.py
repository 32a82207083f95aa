"""Pre-registration, confirm and the hash-chained ledger and deviation log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol import prereg, report
from protocol.errors import ProtocolError
from tests.protocol.test_report import make_run

MANIFEST = "ab" * 32


def new_plan(**over) -> dict:
    args = dict(models=["qwen-1.5b"], budgets=[256, 512],
                treatment={"scorer": "alpha", "scorer_params": {"lambda": 0.5}, "accounting": "mean"},
                baseline={"scorer": "triattention", "accounting": "mean"}, k=2, seed=0,
                max_new_tokens=4096, manifest_hash=MANIFEST, code_version="0.1.0+gtest",
                boot=2000, boot_max=2000)
    args.update(over)
    return prereg.build_plan(**args)


class FakeRunner:
    """Writes a run directory from the configuration it is given, like the real runner would.

    fail: {(cell id, arm)} that raise; tamper: {key: value} written into the recorded config
    instead of what was asked (a runner that does not honour the plan)."""

    def __init__(self, fail=(), tamper=None, n=30):
        self.calls, self.configs = [], []
        self.fail, self.tamper, self.n = set(fail), tamper or {}, n

    def __call__(self, cell, arm, cfg, out_dir):
        self.calls.append((cell["id"], arm))
        self.configs.append(cfg)
        if (cell["id"], arm) in self.fail:
            raise RuntimeError("CUDA out of memory")
        recorded = {**cfg, **self.tamper}
        done = sorted((out_dir / arm).glob("*/config.json"))
        if done:  # like `retention run`, a rerun resumes the existing run directory
            return done[0].parent
        return make_run(out_dir / arm, model=cfg["model"], scorer=cfg["scorer"],
                        budget=cfg["budget"], params=cfg.get("scorer_params"), k=cfg["samples"],
                        n=self.n, shift=0.15 if arm == "treatment" else 0.0,
                        seed=len(self.calls), split=recorded["split"], extra=recorded,
                        meta_extra={"plan_hash": cfg["plan_hash"]})


def _log(path) -> list[dict]:
    """Verified entries of a ledger or deviation log, with the key of the plan its lines name."""
    from protocol.ledger import Registry

    lines = [json.loads(x) for x in Path(path).read_text().splitlines()] if Path(path).exists() else []
    if not lines:
        return []
    return prereg.HashChain(path, Registry().require_key(lines[0]["plan_hash"])).entries()


def cli_runner(cell, arm, cfg, out_dir):
    """Runner for the CLI test (`--runner tests.protocol.test_prereg:cli_runner`)."""
    return FakeRunner()(cell, arm, cfg, out_dir)


@pytest.fixture
def plan_file(tmp_path):
    path, h, written = prereg.write_plan(new_plan(), tmp_path)
    assert written
    return path, h


def run_confirm(plan_path, out, runner, **kw):
    kw.setdefault("manifest_hash", MANIFEST)
    kw.setdefault("code_version", "0.1.0+gtest")
    return prereg.confirm(plan_path, out, runner, **kw)


# --------------------------------------------------------------------------------------------------
# plans


def test_plan_is_named_by_its_hash_and_registration_is_idempotent(tmp_path):
    plan = new_plan()
    path, h, written = prereg.write_plan(plan, tmp_path)
    assert written and path.name == f"plan-{h[:12]}.json"
    assert h == prereg.sha256_text(prereg.canonical_json(plan))
    content = path.read_bytes()
    again, h2, written2 = prereg.write_plan(new_plan(), tmp_path)
    assert (again, h2, written2) == (path, h, False) and path.read_bytes() == content
    other = new_plan(max_new_tokens=8192)
    with pytest.raises(ProtocolError, match="different plan"):
        prereg.write_plan(other, path)  # an explicit file holding another plan
    assert path.read_bytes() == content
    path2, h3, _ = prereg.write_plan(other, tmp_path)
    assert h3 != h and path2 != path
    loaded, lh = prereg.load_plan(path)
    assert lh == h and loaded == plan
    assert [c["id"] for c in plan["cells"]] == ["qwen-1.5b@b256", "qwen-1.5b@b512"]
    assert plan["test"]["m"] == 2 and plan["split"] == "confirm"


@pytest.mark.parametrize("bad,match", [
    (dict(m=1), "smaller than the number of cells"),
    (dict(baseline={"scorer": "alpha", "scorer_params": {"lambda": 0.5}, "accounting": "mean"}), "identical"),
    (dict(treatment={"scorer": "alpha", "budget": 3}), "plan-level"),
    (dict(treatment={"scorer_params": {}}), "scorer"),
    (dict(budgets=[0]), "positive"),
    (dict(manifest_hash="xyz"), "64 hex"),
    (dict(alpha=1.5), "alpha"),
])
def test_bad_plans_refused(bad, match):
    with pytest.raises(ProtocolError, match=match):
        new_plan(**bad)


def test_plan_edited_after_registration_is_detected(plan_file, tmp_path):
    path, h = plan_file
    doc = json.loads(path.read_text())
    doc["plan"]["max_new_tokens"] = 32768  # keep the registered hash, change the content
    path.write_text(json.dumps(doc))
    with pytest.raises(ProtocolError, match="edited after registration"):
        prereg.load_plan(path)
    with pytest.raises(ProtocolError, match="edited after registration"):
        run_confirm(path, tmp_path / "c", FakeRunner())
    # Re-hashing the edited body makes a different plan, which its old name no longer matches.
    doc["plan_hash"] = prereg.plan_hash(doc["plan"])
    path.write_text(json.dumps(doc))
    with pytest.raises(ProtocolError, match="file name"):
        prereg.load_plan(path)


# --------------------------------------------------------------------------------------------------
# confirm


def test_confirm_runs_every_cell_and_records_provenance(plan_file, tmp_path):
    path, h = plan_file
    runner = FakeRunner()
    out = tmp_path / "confirm"
    entries = run_confirm(path, out, runner)
    assert runner.calls == [("qwen-1.5b@b256", "baseline"), ("qwen-1.5b@b256", "treatment"),
                            ("qwen-1.5b@b512", "baseline"), ("qwen-1.5b@b512", "treatment")]
    for cfg in runner.configs:
        assert cfg["split"] == "confirm" and cfg["plan_hash"] == h
        assert (cfg["samples"], cfg["seed"], cfg["max_new_tokens"]) == (2, 0, 4096)
    assert runner.configs[1]["scorer_params"] == {"lambda": 0.5}
    ledger = _log(prereg.ledger_path(out))
    assert [e["cell_id"] for e in ledger] == ["qwen-1.5b@b256", "qwen-1.5b@b512"]
    for entry in ledger:
        assert entry["plan_hash"] == h and entry["code_version"] == "0.1.0+gtest"
        assert entry["model_revision"] == "rev-1" and entry["deviations"] == []
        res = entry["result"]
        assert (res["n"], res["k"], res["boot"], res["m"]) == (30, 2, 2000, 2)
        for arm in ("baseline", "treatment"):
            run_dir = out / entry["runs"][arm]["path"]
            side = json.loads((run_dir / "confirm.json").read_text())
            assert side["plan_hash"] == h and side["ledger_entry"] == entry["hash"]
            assert side["model_revision"] == "rev-1" and side["code_version"] == "0.1.0+gtest"
    # The recorded result is the registered test, reproducible from the run directories.
    from protocol import stats

    t = report.load_run(out / ledger[0]["runs"]["treatment"]["path"])
    b = report.load_run(out / ledger[0]["runs"]["baseline"]["path"])
    again = stats.paired_test(report.pair_runs(t, b), alpha=0.05, m=2, boot=2000, boot_max=2000, seed=0)
    assert again.to_dict() == ledger[0]["result"]
    assert entries[0]["hash"] == ledger[0]["hash"]
    assert _log(prereg.deviations_path(out)) == []


def test_second_confirmation_is_refused(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    run_confirm(path, out, FakeRunner())
    runner = FakeRunner()
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(path, out, runner)
    with pytest.raises(ProtocolError, match="second confirmation"):
        run_confirm(path, out, runner, cells=["qwen-1.5b@b256"])
    assert runner.calls == []
    assert len(_log(prereg.ledger_path(out))) == 2


@pytest.mark.parametrize("kw,match", [
    (dict(manifest_hash="cd" * 32), "split manifest"),
    (dict(config_schema=prereg.CONFIG_SCHEMA_VERSION + 1), "configuration schema"),
    (dict(cells=["qwen-1.5b@b9"]), "not in plan"),
    (dict(overrides={"max_new_tokens": 8192}), "needs a reason"),
    (dict(overrides={"split": "dev"}, reason="x"), "cannot override"),
    (dict(overrides={"stats_sha256": "0" * 64}, reason="x"), "cannot override"),
    (dict(overrides={"dataset": "aime24"}, reason="x"), "cannot override"),
])
def test_confirm_refusals(plan_file, tmp_path, kw, match):
    path, _ = plan_file
    runner = FakeRunner()
    with pytest.raises(ProtocolError, match=match):
        run_confirm(path, tmp_path / "c", runner, **kw)
    assert runner.calls == []


def test_manifest_hash_read_from_splits_by_default(plan_file, tmp_path, monkeypatch):
    import protocol.confirmation  # reads `protocol.splits.manifest_sha256`, imported at its top

    path, _ = plan_file
    monkeypatch.setattr(protocol.confirmation, "manifest_sha256", lambda splits_dir=None, dataset="math500": "ef" * 32)
    with pytest.raises(ProtocolError, match="split manifest"):
        prereg.confirm(path, tmp_path / "c", FakeRunner(), code_version="0.1.0+gtest")
    monkeypatch.setattr(protocol.confirmation, "manifest_sha256", lambda splits_dir=None, dataset="math500": MANIFEST)
    assert len(prereg.confirm(path, tmp_path / "c", FakeRunner(), code_version="0.1.0+gtest")) == 2


def test_ledger_of_another_plan_is_refused(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    run_confirm(path, out, FakeRunner())
    other, _, _ = prereg.write_plan(new_plan(budgets=[1024]), tmp_path)
    with pytest.raises(ProtocolError, match="belongs to another plan"):
        run_confirm(other, out, FakeRunner())


def test_crash_is_logged_and_the_rerun_recorded(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    with pytest.raises(ProtocolError, match="crashed"):
        run_confirm(path, out, FakeRunner(fail={("qwen-1.5b@b512", "treatment")}))
    assert [e["cell_id"] for e in _log(prereg.ledger_path(out))] == ["qwen-1.5b@b256"]
    devs = _log(prereg.deviations_path(out))
    assert [(d["kind"], d["cell_id"], d["arm"]) for d in devs] == [("crash", "qwen-1.5b@b512", "treatment")]
    assert "out of memory" in devs[0]["error"]
    runner = FakeRunner()
    entries = run_confirm(path, out, runner)
    assert {c for c, _ in runner.calls} == {"qwen-1.5b@b512"}  # the confirmed cell is not rerun
    kinds = [d["kind"] for d in _log(prereg.deviations_path(out))]
    assert kinds == ["crash", "rerun_after_crash"]
    assert len(entries[0]["deviations"]) == 1


def test_overrides_and_runner_mismatches_are_deviations(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    runner = FakeRunner(tamper={"temperature": 0.7})
    run_confirm(path, out, runner, cells=["qwen-1.5b@b256"], overrides={"max_new_tokens": 8192},
                reason="OOM-free limit on this GPU")
    assert all(cfg["max_new_tokens"] == 8192 for cfg in runner.configs)
    devs = _log(prereg.deviations_path(out))
    assert [d["kind"] for d in devs] == ["override"]  # the runner recorded what it was asked
    assert devs[0]["field"] == "max_new_tokens" and devs[0]["reason"] == "OOM-free limit on this GPU"
    runner = FakeRunner(tamper={"max_new_tokens": 1000})
    entry = run_confirm(path, out, runner, cells=["qwen-1.5b@b512"])[0]
    devs = _log(prereg.deviations_path(out))
    mism = [d for d in devs if d["kind"] == "config_mismatch"]
    assert {(d["arm"], d["field"], d["planned"], d["actual"]) for d in mism} == {
        ("baseline", "max_new_tokens", 4096, 1000), ("treatment", "max_new_tokens", 4096, 1000)}
    assert set(entry["deviations"]) == {d["hash"] for d in mism}


def test_run_off_the_confirm_split_is_refused(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    with pytest.raises(ProtocolError, match="confirm split"):
        run_confirm(path, out, FakeRunner(tamper={"split": "dev"}))
    assert _log(prereg.ledger_path(out)) == []


def test_code_version_change_is_a_deviation(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    entries = run_confirm(path, out, FakeRunner(), code_version="0.2.0")
    devs = _log(prereg.deviations_path(out))
    assert [d["kind"] for d in devs] == ["code_version", "code_version"]
    assert all(e["code_version"] == "0.2.0" for e in entries)


# --------------------------------------------------------------------------------------------------
# the hash chain


def _chain(tmp_path, n=3) -> prereg.HashChain:
    chain = prereg.HashChain(tmp_path / "log.jsonl", b"k" * 32)
    for i in range(n):
        chain.append({"kind": "cell", "cell_id": f"c{i}", "value": i})
    return chain


def test_chain_verifies_and_links(tmp_path):
    chain = _chain(tmp_path)
    entries = chain.entries()
    assert entries[0]["prev"] == prereg.GENESIS
    assert [e["prev"] for e in entries[1:]] == [e["hash"] for e in entries[:-1]]


def test_edited_line_detected(tmp_path):
    chain = _chain(tmp_path)
    lines = chain.path.read_text().splitlines()
    assert '"value": 1' in lines[1]
    lines[1] = lines[1].replace('"value": 1', '"value": 7')
    chain.path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ProtocolError, match="line 2|:2:"):
        chain.entries()


@pytest.mark.parametrize("edit", ["remove_first", "reorder", "truncate_tail", "drop_head"])
def test_removed_reordered_or_truncated_lines_detected(tmp_path, edit):
    chain = _chain(tmp_path)
    lines = chain.path.read_text().splitlines(keepends=True)
    if edit == "remove_first":
        lines = lines[1:]
    elif edit == "reorder":
        lines[1], lines[2] = lines[2], lines[1]
    elif edit == "truncate_tail":
        lines = lines[:-1]
    else:
        chain.head_path.unlink()
    chain.path.write_text("".join(lines))
    with pytest.raises(ProtocolError):
        chain.entries()


def test_tampered_ledger_stops_confirm_and_report(plan_file, tmp_path):
    path, h = plan_file
    out = tmp_path / "confirm"
    run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b256"])
    ledger = prereg.ledger_path(out)
    text = ledger.read_text()
    entry = json.loads(text)
    entry["result"]["p_bootstrap"] = 0.001  # a nicer p-value
    ledger.write_text(prereg.canonical_json(entry) + "\n")
    with pytest.raises(ProtocolError, match="hash mismatch"):
        run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b512"])
    with pytest.raises(ProtocolError, match="hash mismatch"):
        report.build_report([out / "runs"], boot=200)


def test_deleted_ledger_does_not_allow_a_second_confirmation(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "confirm"
    run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b256"])
    before = _log(prereg.ledger_path(out))
    prereg.ledger_path(out).unlink()
    Path(str(prereg.ledger_path(out)) + ".head").unlink()
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b256"])
    # the confirm directory's copy is re-created from the registry
    assert [_content(e) for e in _log(prereg.ledger_path(out))] == [_content(e) for e in before]


def _content(e):
    return {k: v for k, v in e.items() if k not in ("prev", "hash")}


# --------------------------------------------------------------------------------------------------
# reports of confirm runs


def test_report_of_confirm_runs_shows_plan_and_deviations(plan_file, tmp_path):
    path, h = plan_file
    out = tmp_path / "confirm"
    run_confirm(path, out, FakeRunner(), overrides={"max_new_tokens": 8192}, reason="limit")
    rep = report.build_report([out / "runs"])  # the registered test
    assert rep.provenance["plan_hashes"] == [h]
    assert [d["kind"] for d in rep.provenance["deviations"]] == ["override", "override"]
    assert rep.settings["m"] == 2  # the plan's m
    assert all(r["plan_hash"] == h for r in rep.comparisons)
    tex = report.to_latex(rep)
    assert "Pre-registration" in tex and h[:12] in tex and "max\\_new\\_tokens" in tex
    assert f"plan: {h[:12]}; 2 deviation(s)" in report.terminal_summary(rep)
    # Records edited after confirmation are flagged.
    run_dir = out / _log(prereg.ledger_path(out))[0]["runs"]["treatment"]["path"]
    recs = (run_dir / "records.jsonl").read_text().splitlines()
    first = json.loads(recs[0])
    first["verdict"] = not first["verdict"]
    (run_dir / "records.jsonl").write_text("\n".join([json.dumps(first), *recs[1:]]) + "\n")
    rep = report.build_report([out / "runs"])  # the registered test
    assert any("records changed since" in n for n in rep.notes)


# --------------------------------------------------------------------------------------------------
# CLI


def _cli(args):
    from retention.cli import main

    return CliRunner().invoke(main, args, catch_exceptions=False)


def _preregister(tmp_path, *extra):
    return _cli(["preregister", "--out", str(tmp_path), "--model", "tiny-random", "--budget", "256",
                 "--budget", "512", "--treatment", '{"scorer": "rkv", "accounting": "mean"}',
                 "--treatment-set", "scorer_params.lambda=0.5", "--baseline-set", "scorer=streaming",
                 "-k", "2", "--max-new-tokens", "4096", "--boot", "2000", "--boot-max", "2000",
                 "--code-version", "0.1.0+gtest", *extra])


def test_cli_preregister_and_confirm(tmp_path, monkeypatch):
    res = _preregister(tmp_path)
    assert res.exit_code == 0, res.output
    plans = list(tmp_path.glob("plan-*.json"))
    assert len(plans) == 1 and "registered" in res.output
    plan, h = prereg.load_plan(plans[0])
    # `scorer_params.lambda` (the --help example) is stored under the parameter's field name, with
    # every other parameter at its resolved value (retention.runs.identity: the canonical arm)
    assert plan["treatment"] == {"scorer": "rkv", "accounting": "mean", "sampler": "inverse-cdf",
                                 "scorer_params": {"kernel": 7, "lam": 0.5, "threshold": 0.5, "window": 8}}
    assert plan["baseline"] == {"scorer": "streaming", "sampler": "inverse-cdf"}  # `--sampler`'s default
    from protocol.splits import manifest_sha256

    want = new_plan(models=["tiny-random"], treatment=plan["treatment"], baseline=plan["baseline"],
                    manifest_hash=manifest_sha256())  # the verified splits' manifest
    # neither rkv nor streaming reads calibration statistics: each cell records None for both arms
    assert plan == prereg.with_cell_stats(want, {})
    assert all(c["stats_sha256"] == {"treatment": None, "baseline": None} for c in plan["cells"])
    res = _preregister(tmp_path)
    assert res.exit_code == 0 and "already registered" in res.output

    out = tmp_path / "confirm"
    base = ["confirm", "--plan", str(plans[0]), "--out", str(out),
            "--code-version", "0.1.0+gtest"]
    monkeypatch.setattr(prereg, "DEFAULT_RUNNER", None)
    import retention.runs.jobs as jobs

    monkeypatch.delattr(jobs, "confirm_runner", raising=False)
    res = _cli(base)
    assert res.exit_code != 0 and "no generation runner" in res.output
    res = _cli(base + ["--runner", "tests.protocol.test_prereg:cli_runner", "--cell", "tiny-random@b256"])
    assert res.exit_code == 0, res.output
    assert "confirmed" in res.output
    monkeypatch.setattr(prereg, "DEFAULT_RUNNER", FakeRunner())
    res = _cli(base)
    assert res.exit_code == 0, res.output
    assert "already confirmed, not rerun: tiny-random@b256" in res.output
    res = _cli(base)
    assert res.exit_code != 0 and res.output.startswith("Error:") and "already confirmed" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_cli_preregister_refuses_overwrite_and_bad_budget(tmp_path):
    target = tmp_path / "plan.json"
    assert _preregister(target).exit_code == 0
    before = target.read_bytes()
    res = _preregister(target, "--seed", "5")
    assert res.exit_code != 0 and "different plan" in res.output
    assert target.read_bytes() == before
    res = _preregister(tmp_path, "--budget", "-3")
    assert res.exit_code != 0 and "budget must be > 0" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = _preregister(tmp_path, "--treatment-set", "lambda")
    assert res.exit_code != 0 and "KEY=VALUE" in res.output


def test_mismatch_compares_numbers_by_value():
    assert prereg._mismatches({"temperature": 0, "top_p": 0.95}, {"temperature": 0.0, "top_p": 0.95}) == []
    assert prereg._mismatches({"temperature": 0}, {"temperature": 0.6})[0]["field"] == "temperature"
    assert prereg._mismatches({"fidelity": True}, {"fidelity": 1})[0]["field"] == "fidelity"
    assert prereg._mismatches({"p": {"lam": 1}}, {"p": {"lam": 1.0}}) == []
