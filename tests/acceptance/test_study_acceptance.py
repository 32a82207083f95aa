"""The study at its real shape, run as a user runs it, with every figure of the verdict recomputed.

Two models, each calibrated on its own (the seeded tiny Qwen2 and a tiny Llama folder with another
RoPE base), budgets 64 and 128 (m = 4), alpha vs TriAttention, k = 2, a lambda sweep on the dev
split, `preregister` of the 4 cells, `confirm` as 2 shards (one killed mid-way and resumed), then
`report`. Every figure of the report (accuracies, delta, SE, CI, p, p_bonf with m = 4, the verdict,
alpha and B as registered) is recomputed here from the records with numpy alone.

Tiny random models solve no MATH problem, so every verdict would be "wrong" and every delta 0: a
test that cannot tell a right verdict from a wrong one. The plan therefore registers a runner that
generates through the real confirm runner and then grades each record with a seeded oracle of known
accuracy (treatment 0.9 vs baseline 0.2 at budget 128, 0.5 vs 0.5 at 64): one cell pair with a
large effect and one with none, in each model. The same study confirmed with an unregistered runner
that flips verdicts must never read "confirmed".
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.models import model_layout

ROOT = Path(__file__).resolve().parents[2]
BUDGETS = (64, 128)
K = 2
LIMIT = 10  # confirm problems per cell
TOKENS = 16
BOOT = 4000
ALPHA = 0.05
COMMON_ARM = {"interval": 8, "temperature": 0.7, "limit": LIMIT}
# Oracle accuracy per (budget, arm): a strong effect at 128, none at 64.
RATES = {64: {"treatment": 0.5, "baseline": 0.5}, 128: {"treatment": 0.9, "baseline": 0.2}}
RUNNER = "tests.acceptance.test_study_acceptance:oracle_runner"
FLIPPER = "tests.acceptance.test_study_acceptance:flipping_runner"


def cli(*args, ok=True):
    res = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert res.exit_code == 0, res.output
    return res


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------
# Runners (imported by `confirm --runner`)


def _oracle_verdict(cell: dict, arm: str, problem_id: str, sample: int) -> bool:
    """Seeded by the model's name (not its folder's temporary path) and budget: the same grades in
    every run of the test."""
    budget = cell["budget"]
    key = f"{Path(cell['model']).name}|{budget}|{arm}|{problem_id}|{sample}"
    u = int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16**12
    return u < RATES[budget][arm]


def _regrade(run_dir: Path, verdict) -> None:
    """Replace each record's verdict (the records' configuration hash is kept)."""
    path = run_dir / "records.jsonl"
    recs = read_jsonl(path)
    for r in recs:
        r["verdict"] = bool(verdict(r))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    os.replace(tmp, path)


def oracle_runner(cell, arm, arm_config, out_dir, **kw):
    """The real confirm runner, then the seeded oracle's grades (see the module docstring). With
    `shard=` it only generates that shard (a shard is not a result); the final call merges and grades."""
    from retention.runs.jobs import confirm_runner

    run_dir = Path(confirm_runner(cell, arm, arm_config, out_dir, **kw))
    if kw.get("shard") is not None:
        return run_dir
    _regrade(run_dir, lambda r: _oracle_verdict(cell, arm, r["problem_id"], r["sample"]))
    return run_dir


def flipping_runner(cell, arm, arm_config, out_dir, **kw):
    """A runner nobody registered: the oracle with the arms' grades swapped."""
    run_dir = Path(oracle_runner(cell, arm, arm_config, out_dir, **kw))
    other = "baseline" if arm == "treatment" else "treatment"
    _regrade(run_dir, lambda r: _oracle_verdict(cell, other, r["problem_id"], r["sample"]))
    return run_dir


# --------------------------------------------------------------------------------------------------
# The independent recomputation


def recompute(t_recs: list[dict], b_recs: list[dict], *, boot: int, alpha: float, m: int) -> dict:
    """Per-problem sums, estimate, clustered SE, null-centred cluster-bootstrap p, percentile CIs,
    Bonferroni, verdict: numpy only, its own random stream."""
    ids = sorted({r["problem_id"] for r in t_recs})
    assert ids == sorted({r["problem_id"] for r in b_recs})
    a = np.array([sum(r["verdict"] is True for r in t_recs if r["problem_id"] == i) for i in ids])
    b = np.array([sum(r["verdict"] is True for r in b_recs if r["problem_id"] == i) for i in ids])
    n, k = len(ids), len(t_recs) // len(ids)
    d = (a - b) / k
    est = d.mean()
    se = np.sqrt(((d - est) ** 2).sum() / (n * (n - 1)))
    D = a - b
    S = D.sum()
    rng = np.random.default_rng(20261201)
    star = D[rng.integers(0, n, size=(boot, n))].sum(axis=1)
    p = (1 + np.sum(np.abs(star - S) >= abs(S))) / (boot + 1)
    level = 1 - alpha / m
    ci95 = np.quantile(star / (n * k), [0.025, 0.975])
    cib = np.quantile(star / (n * k), [(1 - level) / 2, 1 - (1 - level) / 2])
    reject = p <= alpha / m
    verdict = ("better" if est > 0 else "worse") if reject else "n.s."
    return {"n": n, "k": k, "acc_t": a.sum() / (n * k), "acc_b": b.sum() / (n * k), "delta": est, "se": se,
            "p": p, "p_bonf": min(1.0, m * p), "ci95": ci95, "ci_bonf": cib, "verdict": verdict}


def confirm_runs(conf: Path) -> dict[tuple[str, int], dict[str, list[dict]]]:
    """{(model, budget): {scorer: records}} of a confirm directory's runs."""
    out: dict = {}
    for cfg_path in sorted((conf / "runs").rglob("config.json")):
        config = json.loads(cfg_path.read_text())["config"]
        recs = read_jsonl(cfg_path.parent / "records.jsonl")
        out.setdefault((config["model"], config["budget"]), {})[config["scorer"]] = recs
    return out


def check_row_against(row: dict, mine: dict, *, boot: int, m: int) -> None:
    n, k = mine["n"], mine["k"]
    assert int(row["n"]) == n == LIMIT and int(row["k"]) == k == K
    assert float(row["acc_treatment"]) == pytest.approx(mine["acc_t"], abs=1e-12)
    assert float(row["acc_baseline"]) == pytest.approx(mine["acc_b"], abs=1e-12)
    assert float(row["delta_pp"]) == pytest.approx(100 * mine["delta"], abs=1e-9)
    assert float(row["se_pp"]) == pytest.approx(100 * mine["se"], abs=1e-9)
    # Monte-Carlo quantities: within the resampling error of two independent streams
    p, p_mine = float(row["p_bootstrap"]), mine["p"]
    assert abs(p - p_mine) <= 5 * np.sqrt(p_mine * (1 - p_mine) / boot) + 2 / (boot + 1), (p, p_mine)
    step = 100 / (n * k)  # one resampled success moves a percentile bound by this much
    for lo, hi, ci in (("ci95_lo_pp", "ci95_hi_pp", mine["ci95"]), ("ci_bonf_lo_pp", "ci_bonf_hi_pp", mine["ci_bonf"])):
        assert float(row[lo]) == pytest.approx(100 * ci[0], abs=2 * step)
        assert float(row[hi]) == pytest.approx(100 * ci[1], abs=2 * step)
    assert float(row["p_bonferroni"]) == pytest.approx(min(1.0, m * p), rel=1e-12)
    assert int(row["m"]) == m and int(row["boot"]) == boot
    assert row["verdict"] == mine["verdict"]


# --------------------------------------------------------------------------------------------------
# The study


def make_tiny_llama(folder: Path) -> None:
    """A second model with its own geometry and RoPE base: a seeded random 2-layer Llama (MQA)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from retention.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def kill_mid_shard(env: dict, plan: Path, conf: Path, shard: str) -> bool:
    """Start `confirm --shard` in a process and SIGKILL it once it has written its first record.
    Returns whether it was killed (False: it finished first)."""
    proc = subprocess.Popen([sys.executable, "-m", "retention.cli", "confirm", "--plan", str(plan), "--out", str(conf),
                             "--shard", shard], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if any(p.stat().st_size > 0 for p in conf.rglob("records.shard-*.jsonl")):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.02)
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_study_at_its_real_shape(tmp_path, monkeypatch):
    cache, state = tmp_path / "cache", tmp_path / "state"
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(cache))
    monkeypatch.setenv("RETENTION_STATE_DIR", str(state))
    llama = tmp_path / "tiny-llama"
    make_tiny_llama(llama)
    models = ["tiny-random", str(llama)]

    # 1. each model calibrated on its own (the default per-model location)
    for model in models:
        cli("calibrate", "--model", model, "--tokens", 256)
    assert len(list((cache / "stats").glob("*.safetensors"))) == 2

    # 2. the lambda sweep on dev: both models, both budgets, paired with one TriAttention baseline
    dev = tmp_path / "dev"
    lambdas = (0.25, 0.5)
    for model in models:
        for budget in BUDGETS:
            for lam in lambdas:
                cli("run", "--model", model, "--scorer", "alpha", "--lambda", lam, "--baseline", "triattention",
                    "--budget", budget, "--interval", 8, "--limit", 4, "--samples", K, "--max-new-tokens", TOKENS,
                    "--temperature", 0.7, "--out", dev, "--quiet")
    # the same statistics under another cache root are the same arm: the run resumes, nothing new
    moved = tmp_path / "cache-moved"
    shutil.copytree(cache, moved)
    monkeypatch.setenv("RETENTION_CACHE_DIR", str(moved))
    before = sorted(p.name for p in dev.iterdir())
    out = cli("run", "--model", models[1], "--scorer", "alpha", "--lambda", lambdas[0], "--baseline", "triattention",
              "--budget", BUDGETS[0], "--interval", 8, "--limit", 4, "--samples", K, "--max-new-tokens", TOKENS,
              "--temperature", 0.7, "--out", dev, "--quiet").output
    assert sorted(p.name for p in dev.iterdir()) == before and "8 records" in out
    cli("report", dev, "--baseline", "triattention", "--out", tmp_path / "dev-report", "--boot", 1000)
    dev_rows = read_csv(tmp_path / "dev-report" / "report.csv")
    # every (model, budget, lambda) arm against its own model's baseline: none dropped, m = 8
    assert len(dev_rows) == len(models) * len(BUDGETS) * len(lambdas)
    assert {r["baseline"].split("[")[0] for r in dev_rows} == {"triattention"}
    assert {int(r["m"]) for r in dev_rows} == {len(dev_rows)}
    assert len({(r["model"], r["budget"]) for r in dev_rows}) == 4
    # the lambda of the best mean delta across the four cells (ties: the smaller lambda)
    by_lam = {lam: [] for lam in lambdas}
    for r in dev_rows:
        lam = json.loads((Path(dev) / r["treatment_run"] / "config.json").read_text())["config"]["scorer_params"]["lam"]
        by_lam[lam].append(float(r["delta_pp"]))
    chosen = max(lambdas, key=lambda lam: (np.mean(by_lam[lam]), -lam))

    # 2b. a design-space arm (non-default routing and state) against the same baseline, both models:
    # alpha with per-layer kept sets and an int4 tail at the KiB of 128 full-precision tokens
    ds = tmp_path / "design"
    kib = {m: 128 * model_layout(m, "float32").bytes_per_token / 1024 for m in models}
    for model in models:
        cli("run", "--model", model, "--scorer", "alpha", "--lambda", chosen, "--routing", "per-layer",
            "--state", "quant", "--param", "quant.bits=4", "--param", "quant.keys=token", "--param", "quant.group=8",
            "--budget-bytes", kib[model], "--interval", 8, "--limit", 4, "--samples", K, "--max-new-tokens", TOKENS,
            "--temperature", 0.7, "--out", ds, "--quiet")
        cli("run", "--model", model, "--scorer", "triattention", "--budget", BUDGETS[1], "--interval", 8,
            "--limit", 4, "--samples", K, "--max-new-tokens", TOKENS, "--temperature", 0.7, "--out", ds, "--quiet")
    cli("report", ds, "--baseline", "triattention", "--out", tmp_path / "ds-report", "--boot", 1000)
    ds_rows = read_csv(tmp_path / "ds-report" / "report.csv")
    assert len(ds_rows) == 2
    fam_rows = read_csv(tmp_path / "ds-report" / "design_space.csv")
    assert {r["families"] for r in fam_rows} == {"scoring+routing+state"}  # alpha, per-layer, quant vs triattention
    assert {r["budget"] for r in fam_rows} == {str(BUDGETS[1])}  # the quant arm's KiB: 128 full-precision tokens
    for cfg_path in sorted(ds.glob("*alpha*/config.json")):
        config = json.loads(cfg_path.read_text())["config"]
        assert config["scorer_params"]["routing"] == "per-layer" and config["state"]["name"] == "quant"
        recs = read_jsonl(cfg_path.parent / "records.jsonl")
        # more tokens than the baseline's 128 for the same KiB, held on every record (recomputed)
        assert config["budget"] > BUDGETS[1]
        assert all(r["cache_mean_kib"] <= kib[config["model"]] + 1e-9 and not r["budget_exceeded"] for r in recs)
        (base_cfg,) = [p for p in ds.glob("*triattention*/config.json")
                       if json.loads(p.read_text())["config"]["model"] == config["model"]]
        row = next(r for r in ds_rows if (ds / r["treatment_run"]) == cfg_path.parent)
        mine = recompute(recs, read_jsonl(base_cfg.parent / "records.jsonl"), boot=1000, alpha=ALPHA, m=2)
        assert float(row["delta_pp"]) == pytest.approx(100 * mine["delta"], abs=1e-9)
        assert float(row["acc_treatment"]) == pytest.approx(mine["acc_t"], abs=1e-12)

    # 3. the plan: 4 cells, m = 4, the registered test, the registered runner
    plans = tmp_path / "plans"
    treat = dict(COMMON_ARM, scorer="alpha", scorer_params={"lam": chosen})
    base = dict(COMMON_ARM, scorer="triattention")
    prereg = ["preregister", "--out", plans, "--model", models[0], "--model", models[1], "--budget", BUDGETS[0],
              "--budget", BUDGETS[1], "--treatment", json.dumps(treat), "--baseline", json.dumps(base), "-k", K,
              "--max-new-tokens", TOKENS, "--alpha", ALPHA, "--boot", BOOT, "--boot-max", BOOT]
    cli(*prereg, "--runner", RUNNER)
    (plan,) = plans.glob("plan-*.json")
    body = json.loads(plan.read_text())["plan"]
    assert len(body["cells"]) == 4 and body["test"]["m"] == 4
    shas = {c["id"]: c["stats_sha256"]["treatment"] for c in body["cells"]}
    assert len(set(shas.values())) == 2  # each model its own statistics

    # 4. confirm as 2 shards, shard 1 killed mid-way and resumed, then merged and confirmed once
    conf = tmp_path / "confirm"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cli("confirm", "--plan", plan, "--out", conf, "--shard", "0/2")
    assert kill_mid_shard(env, plan, conf, "1/2"), "shard 1/2 finished before it could be killed"
    cli("confirm", "--plan", plan, "--out", conf, "--shard", "1/2")
    cli("confirm", "--plan", plan, "--out", conf)  # the plan's registered runner
    ledger = [e for e in read_jsonl(conf / "ledger.jsonl") if e.get("kind") == "cell"]
    assert len(ledger) == 4 and all(e["test"]["boot"] == BOOT and e["test"]["m"] == 4 for e in ledger)

    # 5. the report: 4 comparisons, m = 4, alpha and B as registered, every figure recomputed
    out = cli("report", conf / "runs", "--out", tmp_path / "report").output
    rows = read_csv(tmp_path / "report" / "report.csv")
    assert len(rows) == 4, out
    runs = confirm_runs(conf)
    verdicts = {}
    for row in rows:
        recs = runs[(row["model"], int(row["budget"]))]
        assert len(recs["alpha"]) == len(recs["triattention"]) == LIMIT * K  # the killed shard left no hole
        mine = recompute(recs["alpha"], recs["triattention"], boot=BOOT, alpha=ALPHA, m=4)
        check_row_against(row, mine, boot=BOOT, m=4)
        assert row["confirmation"] == "confirmed"
        verdicts[(row["model"], int(row["budget"]))] = row["verdict"]
    assert {v for (mo, b), v in verdicts.items() if b == 128} == {"better"}
    assert {v for (mo, b), v in verdicts.items() if b == 64} == {"n.s."}
    provenance = json.loads((tmp_path / "report" / "report.json").read_text())["provenance"]
    assert json.dumps(provenance).count(str(BOOT)) >= 1
    print("\n" + out)  # the closing note quotes this table beside the recomputation
    for row in rows:
        mine = recompute(runs[(row["model"], int(row["budget"]))]["alpha"],
                         runs[(row["model"], int(row["budget"]))]["triattention"], boot=BOOT, alpha=ALPHA, m=4)
        print(f"recomputed {Path(row['model']).name} b{row['budget']}: delta {100 * mine['delta']:+.1f} pp, "
              f"SE {100 * mine['se']:.2f}, CI95 [{100 * mine['ci95'][0]:+.1f}, {100 * mine['ci95'][1]:+.1f}], "
              f"p {mine['p']:.4g}, p_bonf {mine['p_bonf']:.4g}, {mine['verdict']}  |  report: delta "
              f"{float(row['delta_pp']):+.1f}, p {float(row['p_bootstrap']):.4g}, p_bonf "
              f"{float(row['p_bonferroni']):.4g}, {row['verdict']}")

    # the registered test is the one reported: another alpha or B is refused for confirmed cells
    res = cli("report", conf / "runs", "--out", tmp_path / "r2", "--alpha", 0.9, ok=False)
    assert res.exit_code == 1 and "registered" in res.output.strip().splitlines()[-1]
    # a run reached twice (a copy of one run directory) is not counted twice
    twice = tmp_path / "twice"
    shutil.copytree(conf / "runs", twice / "a")
    res = cli("report", conf / "runs", twice / "a", "--out", tmp_path / "r3", ok=False)
    if res.exit_code == 0:
        assert len(read_csv(tmp_path / "r3" / "report.csv")) == 4
    else:
        assert "twice" in res.output or "same run" in res.output

    # a record of another configuration pasted into a run is refused, not counted
    pasted = tmp_path / "pasted"
    shutil.copytree(conf / "runs", pasted)
    a, b = sorted(pasted.rglob("records.jsonl"))[:2]
    foreign = dict(json.loads(b.read_text().splitlines()[0]), sample=K)  # a new (problem, sample) of another run
    with open(a, "a") as fh:
        fh.write(json.dumps(foreign) + "\n")
    res = cli("report", pasted, "--out", tmp_path / "r4", ok=False)
    assert res.exit_code == 1 and "another configuration" in res.output.strip().splitlines()[-1]

    # one confirmation per cell: the same arms re-registered with another seed are refused
    res = cli(*prereg, "--seed", 1, "--runner", RUNNER, ok=False)
    assert res.exit_code == 1 and "already confirmed" in res.output

    # 6. an unregistered runner that flips verdicts, in a fresh registry: never "confirmed"
    monkeypatch.setenv("RETENTION_STATE_DIR", str(tmp_path / "state2"))
    copy = tmp_path / "plans2"
    copy.mkdir()
    shutil.copy(plan, copy / plan.name)
    conf2 = tmp_path / "confirm2"
    cli("confirm", "--plan", copy / plan.name, "--out", conf2, "--runner", FLIPPER)
    cli("report", conf2 / "runs", "--out", tmp_path / "report2")
    rows2 = read_csv(tmp_path / "report2" / "report.csv")
    assert len(rows2) == 4
    for row in rows2:
        assert row["confirmation"] != "confirmed" and "deviation" in (row["confirmation"] + row["verdict"]).lower()


def read_csv(path: Path) -> list[dict]:
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))
