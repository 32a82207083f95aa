"""One confirmation per (plan, cell) wherever `confirm` runs; keyed chains; kill at every write."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from protocol import chain, confirmation, io, ledger, plans, prereg, report
from protocol.errors import ProtocolError
from tests.protocol.test_prereg import MANIFEST, FakeRunner, _log, new_plan, run_confirm

CELL = "qwen-1.5b@b256"


@pytest.fixture
def plan_file(tmp_path):
    path, h, _ = prereg.write_plan(new_plan(), tmp_path / "plans")
    return path, h


def test_confirm_into_another_out_or_from_another_cwd_or_a_copied_plan_is_refused(plan_file, tmp_path,
                                                                                   monkeypatch):
    path, h = plan_file
    run_confirm(path, tmp_path / "a", FakeRunner(), cells=[CELL])
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(path, tmp_path / "b", FakeRunner(), cells=[CELL])
    monkeypatch.chdir(tmp_path / "a")
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(Path("..") / "plans" / path.name, Path("out"), FakeRunner(), cells=[CELL])
    copy = tmp_path / "elsewhere" / "my-plan.json"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(copy, tmp_path / "c", FakeRunner(), cells=[CELL])
    # the other cell is still open, from anywhere
    assert [e["cell_id"] for e in run_confirm(copy, tmp_path / "c", FakeRunner())] == ["qwen-1.5b@b512"]
    reg = ledger.Registry().ledger(h).entries()
    assert sorted(e["cell_id"] for e in reg) == [CELL, "qwen-1.5b@b512"]


def test_deleting_every_ledger_copy_does_not_reopen_a_cell(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "a"
    run_confirm(path, out, FakeRunner(), cells=[CELL])
    for p in (ledger.ledger_path(out), ledger.plan_ledger_path(path)):
        p.unlink()
        Path(f"{p}.head").unlink()
    shutil.rmtree(out)
    with pytest.raises(ProtocolError, match="already confirmed"):
        run_confirm(path, tmp_path / "b", FakeRunner(), cells=[CELL])
    # the copy beside the plan was restored from the registry
    assert [e["cell_id"] for e in _log(ledger.plan_ledger_path(path))] == [CELL]


def test_wiping_the_registry_does_not_reopen_a_cell(plan_file, tmp_path):
    path, _ = plan_file
    run_confirm(path, tmp_path / "a", FakeRunner(), cells=[CELL])
    shutil.rmtree(ledger.state_dir())
    with pytest.raises(ProtocolError, match="not registered"):
        run_confirm(path, tmp_path / "b", FakeRunner(), cells=[CELL])


def _recompute_sha256_chain(path: Path) -> None:
    """What a naive forger does: edit a line, recompute the plain sha256 chain and the head."""
    prev, lines = "0" * 64, []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        e.pop("hash")
        if "result" in e:
            e["result"]["p_bootstrap"] = 1e-6
        e["prev"] = prev
        e["hash"] = hashlib.sha256((prev + io.canonical_json(e)).encode()).hexdigest()
        prev = e["hash"]
        lines.append(json.dumps(e))
    path.write_text("\n".join(lines) + "\n")
    Path(f"{path}.head").write_text(json.dumps({"count": len(lines), "hash": prev}))


def test_a_recomputed_chain_does_not_pass(plan_file, tmp_path):
    path, h = plan_file
    out = tmp_path / "a"
    run_confirm(path, out, FakeRunner(), cells=[CELL])
    for p in (ledger.ledger_path(out), ledger.plan_ledger_path(path), ledger.Registry().plan_dir(h) / "ledger.jsonl"):
        saved = {q: q.read_bytes() for q in (p, Path(f"{p}.head"))}
        _recompute_sha256_chain(p)
        with pytest.raises(ProtocolError, match="hash mismatch"):
            run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b512"])
        if p != ledger.plan_ledger_path(path):  # report reads the confirm directory and the registry
            with pytest.raises(ProtocolError, match="hash mismatch"):
                report.build_report([out / "runs"], boot=200)
        for q, data in saved.items():
            q.write_bytes(data)
    assert len(run_confirm(path, out, FakeRunner(), cells=["qwen-1.5b@b512"])) == 1


def test_report_flags_confirm_runs_without_a_valid_ledger_entry(plan_file, tmp_path):
    path, h = plan_file
    out = tmp_path / "a"
    run_confirm(path, out, FakeRunner(), cells=[CELL])
    rep = report.build_report([out / "runs"])  # a confirmed cell: the registered test
    assert rep.comparisons[0]["confirmation"] == "confirmed" and not rep.provenance["unconfirmed"]
    assert "UNCONFIRMED" not in report.terminal_summary(rep)
    # records flipped after confirmation
    run_dir = out / _log(ledger.ledger_path(out))[0]["runs"]["treatment"]["path"]
    recs = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]
    for r in recs:
        r["verdict"] = True
    (run_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    rep = report.build_report([out / "runs"])
    row = rep.comparisons[0]
    assert row["verdict"].startswith("UNCONFIRMED") and "records changed" in row["confirmation"]
    text = report.terminal_summary(rep)
    assert text.startswith("!" * 78) and "NOT pre-registered evidence" in text
    assert "UNCONFIRMED" in report.to_latex(rep)
    # confirm-split runs with no ledger at all (never confirmed)
    loose = tmp_path / "loose"
    FakeRunner()({"id": "x", "model": "qwen-1.5b", "budget": 256}, "treatment",
                 prereg.arm_config(new_plan(), h, {"model": "qwen-1.5b", "budget": 256}, "treatment"), loose)
    FakeRunner()({"id": "x", "model": "qwen-1.5b", "budget": 256}, "baseline",
                 prereg.arm_config(new_plan(), h, {"model": "qwen-1.5b", "budget": 256}, "baseline"), loose)
    rep = report.build_report([loose], boot=300)
    assert rep.comparisons[0]["verdict"].startswith("UNCONFIRMED")
    assert all("no ledger entry" in why or "records changed" in why
               for why in rep.provenance["unconfirmed"].values())
    # runs naming a plan this registry does not know
    stray = tmp_path / "stray"
    for arm in ("treatment", "baseline"):
        cfg = prereg.arm_config(new_plan(seed=9), "f" * 64, {"model": "qwen-1.5b", "budget": 256}, arm)
        FakeRunner()({"id": "x", "model": "qwen-1.5b", "budget": 256}, arm, cfg, stray)
    rep = report.build_report([stray], boot=300)
    assert all("not in the registry" in why for why in rep.provenance["unconfirmed"].values())
    assert len(rep.provenance["unconfirmed"]) == 2


def test_input_errors_inside_confirm_are_errors_not_crashes(plan_file, tmp_path):
    path, _ = plan_file
    out = tmp_path / "a"

    def refuse(cfg):
        raise ProtocolError(f"bad scorer {cfg['scorer']!r}")

    runner = FakeRunner()
    with pytest.raises(ProtocolError, match="bad scorer"):
        run_confirm(path, out, runner, validate=refuse)
    assert runner.calls == []  # nothing generated

    def runner_input_error(cell, arm, cfg, out_dir):
        raise ProtocolError("--data: not UTF-8")

    with pytest.raises(ProtocolError, match="not UTF-8"):
        run_confirm(path, out, runner_input_error)
    assert _log(ledger.deviations_path(out)) == []


# --------------------------------------------------------------------------------------------------
# kill at every write point


class Killed(BaseException):
    """A simulated `kill -9`: not an Exception, so no handler logs it as a crash deviation."""


class Killer:
    """Counts the writes of protocol.io; at write number `at`, performs half of it and dies."""

    def __init__(self, monkeypatch, at: int):
        self.n, self.at, self.points = 0, at, []
        real_append, real_atomic = io.append_line, io.write_atomic

        def append_line(path, line, **kw):
            self._tick(f"append {Path(path).name}")
            if self.n == self.at:
                with open(path, "ab") as fh:
                    fh.write(line[: len(line) // 2])
                raise Killed
            return real_append(path, line, **kw)

        def write_atomic(path, data):
            self._tick(f"replace {Path(path).name}")
            if self.n == self.at:
                raise Killed  # an atomic replace killed midway leaves the old file
            return real_atomic(path, data)

        for mod in (io, chain, ledger, prereg, plans, confirmation):
            if hasattr(mod, "append_line"):
                monkeypatch.setattr(mod, "append_line", append_line)
            if hasattr(mod, "write_atomic"):
                monkeypatch.setattr(mod, "write_atomic", write_atomic)

    def _tick(self, what):
        self.n += 1
        self.points.append(what)


def resumable_runner(cell, arm, cfg, out_dir):
    """A runner writing like `retention run`: config.json atomically, then one record per append,
    resuming after a kill (a half-written last line is cut off)."""
    d = Path(out_dir) / arm / "run"
    d.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(io.canonical_json(cfg).encode()).hexdigest()  # reports check it
    if not (d / "config.json").exists():
        io.write_json(d / "config.json", {"run_id": f"{cell['id']}-{arm}", "config_hash": digest,
                                         "config": cfg, "plan_hash": cfg["plan_hash"]})
    have = set()
    if (d / "records.jsonl").exists():
        read = io.read_jsonl(d / "records.jsonl", "record")
        with open(d / "records.jsonl", "r+b") as fh:
            fh.truncate(read.valid_end)
        have = {(r["problem_id"], r["sample"]) for r in read.objects}
    for i in range(6):
        for j in range(cfg["samples"]):
            if (f"p{i}", j) in have:
                continue
            bit = hashlib.sha256(f"{arm}{i}{j}{cell['id']}".encode()).digest()[0] < (150 if arm == "treatment" else 110)
            io.append_line(d / "records.jsonl", io.jsonl_line(
                {"config_hash": digest, "problem_id": f"p{i}", "sample": j, "verdict": bit, "text": "x", "gold": "1",
                 "output_tokens": 10, "finish_reason": "eos", "cache_mean_tokens": 1.0,
                 "cache_peak_tokens": 1, "kib_per_token": 1.0, "cache_mean_kib": 1.0,
                 "budget_exceeded": False}))
    return d


def _state(path, out, h):
    reg = ledger.Registry().ledger(h).entries()
    beside, local = _log(ledger.plan_ledger_path(path)), _log(ledger.ledger_path(out))
    results = {e["cell_id"]: e["result"] for e in reg}
    for chain in (reg, beside, local):
        assert sorted(e["cell_id"] for e in chain) == sorted(results), "each cell exactly once"
        assert {e["cell_id"]: e["result"] for e in chain} == results
    plan, _ = prereg.load_plan(path)
    for cell in plan["cells"]:  # the cell registry: started, then confirmed, once each
        attempts = ledger.Registry().cell_attempts(prereg.cell_key(prereg.cell_identity(plan, cell)))
        assert [a["status"] for a in attempts] == ["started", "confirmed"], attempts
        assert {a["plan_hash"] for a in attempts} == {h}
    for e in local:  # sidecars name the confirm directory's entry and the records they confirmed
        for arm, info in e["runs"].items():
            side = json.loads((out / info["path"] / "confirm.json").read_text())
            assert side["ledger_entry"] == e["hash"]
            assert side["records_sha256"] == io.sha256_file(out / info["path"] / "records.jsonl")
    return results


def test_confirm_killed_at_every_write_point_recovers(tmp_path, monkeypatch):
    base = tmp_path / "uninterrupted"
    plan = new_plan(budgets=[256], k=1, boot=100, boot_max=100)
    path, h, _ = prereg.write_plan(plan, base)
    run_confirm(path, base / "out", resumable_runner)
    want = _state(path, base / "out", h)
    killed_at, n = [], 0
    while True:
        n += 1
        case = tmp_path / f"kill{n}"
        monkeypatch.setenv(ledger.STATE_ENV, str(case / "state"))
        path, h2, _ = prereg.write_plan(plan, case)
        assert h2 == h
        with monkeypatch.context() as m:
            killer = Killer(m, n)
            try:
                run_confirm(path, case / "out", resumable_runner)
                break  # n is past the last write point
            except Killed:
                killed_at.append(killer.points[-1])
        try:
            run_confirm(path, case / "out", resumable_runner)  # the rerun recovers
        except ProtocolError as exc:  # killed after the last cell's commit: only copies to finish
            assert "already confirmed" in str(exc)
        assert _state(path, case / "out", h) == want, f"killed at write {n} ({killed_at[-1]})"
        rep = report.build_report([case / "out" / "runs"], subset_boot=10)
        assert not rep.provenance["unconfirmed"], rep.provenance["unconfirmed"]
    kinds = {p.split(".")[0] for p in killed_at}
    assert {"append records", "append ledger", "replace ledger", "replace confirm"} <= kinds, kinds
    cell_file = f"{prereg.cell_key(prereg.cell_identity(plan, plan['cells'][0]))}.jsonl"
    assert {f"append {cell_file}", f"replace {cell_file}.head"} <= set(killed_at)  # the cell registry too
    assert len(killed_at) >= 20
    print(f"confirm killed at {len(killed_at)} write points, each recovered: "
          f"{sorted(set(killed_at))}")
