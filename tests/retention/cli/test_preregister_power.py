"""`preregister --dev/--time-slots`: each cell's MDE from real dev runs and the predicted confirm time,
printed and recorded in the plan; a plan above the bound is refused unless allowed (recorded)."""

import json

import numpy as np
import pytest

from protocol.power import cell_power, paired_matrix
from protocol.runs import find_run_dirs, load_run
from retention.runs.power_inputs import same_arm
from tests.cli import invoke as cli

COMMON = {"interval": 8, "temperature": 0.7}


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    """Two dev arms of tiny-random (4 problems x 2 samples), their verdicts then set to a seeded
    pattern with discordant pairs (tiny-random solves nothing)."""
    out = tmp_path_factory.mktemp("dev")
    res = cli("run", "--model", "tiny-random", "--scorer", "streaming,random", "--budget", 64, "--interval", 8,
              "--limit", 4, "--samples", 2, "--max-new-tokens", 4, "--temperature", 0.7, "--out", out, "--quiet")
    assert res.exit_code == 0, res.output
    rng = np.random.default_rng(3)
    for d in find_run_dirs([out]):
        recs = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
        for r in recs:
            r["verdict"] = bool(rng.random() < 0.5)
        (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out


def prereg(out, dev, *extra):
    return cli("preregister", "--out", out, "--model", "tiny-random", "--budget", 64,
               "--treatment", json.dumps(dict(COMMON, scorer="streaming")),
               "--baseline", json.dumps(dict(COMMON, scorer="random")), "-k", 2, "--max-new-tokens", 4,
               "--boot", 500, "--boot-max", 500, "--dev", dev, *extra)


def plan_of(out):
    (path,) = out.glob("plan-*.json")
    return json.loads(path.read_text())["plan"]


def test_mde_printed_recorded_and_recomputed(tmp_path, dev):
    res = prereg(tmp_path / "plans", dev, "--mde-bound", 100, "--time-slots", 2)
    assert res.exit_code == 0, res.output
    power = plan_of(tmp_path / "plans")["power"]
    (cell,) = power["cells"].values()
    runs = {load_run(d).scorer: load_run(d) for d in find_run_dirs([dev])}
    want = cell_power(paired_matrix(runs["streaming"], runs["random"]), n=299, k=2, alpha=0.05, m=1)
    assert cell["mde_pp"] == pytest.approx(want.mde_pp) and cell["n"] == 299 and cell["k"] == 2
    assert cell["dev_treatment_run"] == runs["streaming"].run_id
    assert f"MDE {want.mde_pp:.1f} pp at n=299, k=2" in res.output
    wall = power["wall_time"]
    assert wall["slots"] == 2 and wall["total_seconds"] > 0 and "predicted confirm wall time" in res.output
    assert power["allow_underpowered"] is False and power["mde_bound_pp"] == 100


def test_above_the_bound_is_refused_unless_allowed(tmp_path, dev):
    res = prereg(tmp_path / "a", dev, "--mde-bound", 0.5)
    assert res.exit_code == 1 and "cannot detect less than 0.5 pp" in res.output
    assert not list((tmp_path / "a").glob("plan-*.json"))
    res = prereg(tmp_path / "b", dev, "--mde-bound", 0.5, "--allow-underpowered")
    assert res.exit_code == 0, res.output
    assert plan_of(tmp_path / "b")["power"]["allow_underpowered"] is True and "allowed" in res.output


def test_no_matching_dev_run_is_one_line(tmp_path, dev):
    res = cli("preregister", "--out", tmp_path, "--model", "tiny-random", "--budget", 64,
              "--treatment", json.dumps(dict(COMMON, scorer="h2o")), "--baseline", json.dumps(dict(COMMON, scorer="random")),
              "-k", 2, "--max-new-tokens", 4, "--dev", dev)
    assert res.exit_code == 1 and "no dev run of cell tiny-random@b64 matches the plan's treatment" in res.output


def test_a_quantised_checkpoints_dev_run_is_its_arm(dev):
    """A GGUF-backed model's runs record what was loaded (`model_quant`, id, revision); the plan's arm names the
    model only, so those keys must not part a dev run from its arm; a key of the arm still does."""
    run = load_run(find_run_dirs([dev])[0])
    loaded = dict(run.config, model_quant="Q4_K_M", model_id="pkg==1.0", model_revision="sha256:ab")
    assert same_arm(loaded, run.config)
    assert not same_arm(dict(loaded, interval=run.config["interval"] + 1), run.config)
