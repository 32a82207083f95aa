"""The main job end to end through the CLI: calibrate -> run (paired arms) -> grade -> report, and a
pre-registered confirm, asserting on what the outputs contain."""

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from protocol.splits import split_ids
from retention.cli import main


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.output


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]


def run_dir_of(parent: Path, scorer: str) -> Path:
    (d,) = [p for p in parent.iterdir() if json.loads((p / "config.json").read_text())["config"]["scorer"] == scorer]
    return d


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main_job(tmp_path, model, *, budget, interval, problems, samples, tokens, temperature, calib_tokens):
    stats = tmp_path / "stats.safetensors"
    runs = tmp_path / "runs"
    cli("calibrate", "--model", model, "--out", stats, "--tokens", calib_tokens)
    common = ["--model", model, "--limit", problems, "--samples", samples, "--max-new-tokens", tokens,
              "--temperature", temperature, "--out", runs, "--quiet"]
    cli("run", *common, "--scorer", "alpha", "--baseline", "triattention", "--lambda", "0.5", "--budget", budget,
        "--interval", interval, "--stats", stats, "--fidelity")
    cli("run", *common, "--scorer", "full", "--fidelity")
    out = cli("report", runs, "--baseline", "triattention", "--out", tmp_path / "report", "--boot", 2000)
    return stats, runs, out


def check_main_job(tmp_path, runs, out, *, budget, problems, samples):
    alpha, tri, full = (run_dir_of(runs, s) for s in ("alpha", "triattention", "full"))
    ra, rt, rf = records(alpha), records(tri), records(full)
    dev = set(split_ids("dev"))
    keys = lambda rs: sorted((r["problem_id"], r["sample"], r["seed"]) for r in rs)  # noqa: E731
    # the three arms are paired: same problems (from the dev split), same samples, same seeds
    assert keys(ra) == keys(rt) == keys(rf) and len(ra) == problems * samples
    assert {r["problem_id"] for r in ra} <= dev
    for r in ra + rt + rf:
        assert r["verdict"] in (True, False, None) and "extracted" in r and "reason" in r and r["gold"]
        assert r["verdict"] is not None or r["reason"] in ("no_answer", "timeout", "unparsable")
    for r in ra + rt:
        assert r["cache_mean_tokens"] <= budget and not r["budget_exceeded"] and r["compactions"] >= 1
        assert r["fidelity"]["steps"] == r["output_tokens"]
    for r in rf:  # the full cache along its own tokens: exact at every step
        assert r["fidelity"]["kl_max"] == 0.0 and r["fidelity"]["top1_agreement"] == 1.0
        assert r["fidelity"]["first_divergence_step"] is None and r["budget"] is None

    # grading a run's records with `retention grade` gives the verdicts written during the run
    graded = tmp_path / "graded.jsonl"
    cli("grade", alpha / "records.jsonl", "--out", graded)
    regraded = [json.loads(line) for line in graded.read_text().splitlines()]
    assert [r["verdict"] for r in regraded] == [r["verdict"] for r in ra]

    # the report compares alpha with triattention in the budget cell, full is the reference row
    rows = read_csv(tmp_path / "report" / "report.csv")
    assert len(rows) == 1
    row = rows[0]
    assert (row["treatment"], row["baseline"]) == ("alpha", "triattention")
    assert int(row["n"]) == problems and int(row["k"]) == samples and int(row["budget"]) == budget
    acc = lambda rs: sum(r["verdict"] is True for r in rs) / len(rs)  # noqa: E731
    assert float(row["acc_treatment"]) == pytest.approx(acc(ra)) and float(row["acc_baseline"]) == pytest.approx(acc(rt))
    arms = {a["label"]: a for a in read_csv(tmp_path / "report" / "arms.csv")}
    assert set(arms) == {"alpha", "triattention", "full"}
    mean_cache = sum(r["cache_mean_tokens"] for r in ra) / len(ra)
    assert float(arms["alpha"]["cache_mean_tokens"]) == pytest.approx(mean_cache)
    assert float(arms["full"]["kl_mean"]) == 0.0 and float(arms["alpha"]["kl_mean"]) > 0.0
    for name in ("report.tex", "accuracy_vs_cache.png", "cache_trace.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "alpha vs triattention" in out and "KL mean" in out


def test_main_job_tiny_random(tmp_path):
    stats, runs, out = main_job(tmp_path, "tiny-random", budget=40, interval=8, problems=3, samples=2, tokens=24,
                                temperature=0.7, calib_tokens=256)
    check_main_job(tmp_path, runs, out, budget=40, problems=3, samples=2)

    # A pre-registered confirmation through the same generation code, on the confirm split.
    plan_dir = tmp_path / "plans"
    arm = {"interval": 8, "temperature": 0.7, "limit": 2, "scorer_params": {"stats": str(stats.resolve())}}
    treat = dict(arm, scorer="alpha", scorer_params=dict(arm["scorer_params"], lam=0.5))
    base = dict(arm, scorer="triattention")
    cli("preregister", "--out", plan_dir, "--model", "tiny-random", "--budget", 40, "--treatment", json.dumps(treat),
        "--baseline", json.dumps(base), "-k", 2, "--max-new-tokens", 16, "--boot", 2000, "--boot-max", 2000)
    (plan,) = plan_dir.glob("plan-*.json")
    plan_hash = json.loads(plan.read_text())["plan_hash"]
    conf = tmp_path / "confirm"
    cli("confirm", "--plan", plan, "--out", conf)
    ledger = [json.loads(line) for line in (conf / "ledger.jsonl").read_text().splitlines()]
    cells = [e for e in ledger if e.get("kind") == "cell"]
    assert len(cells) == 1 and cells[0]["cell_id"] == "tiny-random@b40" and cells[0]["plan_hash"] == plan_hash
    confirm_ids = set(split_ids("confirm"))
    for arm_name in ("alpha", "triattention"):
        d = run_dir_of(conf / "runs" / "tiny-random@b40", arm_name)
        meta = json.loads((d / "config.json").read_text())
        assert meta["config"]["split"] == "confirm" and meta["config"]["plan_hash"] == plan_hash
        rs = records(d)
        assert len(rs) == 4 and {r["problem_id"] for r in rs} <= confirm_ids
    # the registered configuration ran as written: no deviation
    devs = conf / "deviations.jsonl"
    assert not devs.exists() or not [line for line in devs.read_text().splitlines() if '"config_mismatch"' in line]
    # a second confirmation of the cell is refused
    res = CliRunner().invoke(main, ["confirm", "--plan", str(plan), "--out", str(conf), "--cell", "tiny-random@b40"])
    assert res.exit_code != 0 and "already confirmed" in res.output
    out = cli("report", conf / "runs", "--out", tmp_path / "confirm_report", "--boot", 2000)
    assert plan_hash[:12] in out


@pytest.mark.smollm
def test_main_job_smollm(tmp_path, smollm):
    _, runs, out = main_job(tmp_path, "smollm2-135m", budget=32, interval=16, problems=2, samples=1, tokens=40,
                            temperature=0, calib_tokens=512)
    check_main_job(tmp_path, runs, out, budget=32, problems=2, samples=1)
