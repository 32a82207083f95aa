"""The example plugin (examples/keynorm-scorer) installed as a user would: `pip install` into a
folder of its own, then `retention run`, `check-scorer`, `preregister` and `confirm` by its
entry-point name in fresh processes; a changed plugin is refused on resume and on confirm."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "keynorm-scorer"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The example installed (not editable, no dependencies) into a folder put on PYTHONPATH."""
    pytest.importorskip("setuptools", reason="building the example needs setuptools (the test extra)")
    tmp = tmp_path_factory.mktemp("keynorm")
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(src)], check=True, capture_output=True, text=True)
    return target


def retention(site, *args, check=True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "retention.cli", *map(str, args)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def test_run_check_preregister_confirm_and_refusals(site, tmp_path):
    # run by its entry-point name, a parameter by the plugin's name
    runs = tmp_path / "runs"
    common = ["run", "--model", "tiny-random", "--scorer", "keynorm", "--param", "keynorm.power=2", "--budget", 40,
              "--limit", 2, "--max-new-tokens", 12, "--out", runs, "--quiet", "--batch-size", 2]
    out = retention(site, *common).stdout
    (run_dir,) = runs.iterdir()
    assert "2 records" in out and run_dir.name.startswith("tiny-random-keynorm-b40-")
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    plugin = cfg["scorer_plugin"]
    assert plugin["spec"] == "keynorm" and plugin["version"] == "0.1.0"
    assert plugin["distribution"].replace("_", "-") == "keynorm-scorer"
    assert set(plugin["sources_sha256"]) == {"keynorm_scorer/__init__.py", "keynorm_scorer/decoding.py"}

    # the contract kit
    check = retention(site, "check-scorer", "keynorm", "--context", 0).stdout
    assert "keynorm: 13/13 checks pass" in check and "FAIL" not in check

    # pre-registered against streaming, confirmed on the confirm split
    plans = tmp_path / "plans"
    arm = {"interval": 8, "limit": 2}
    retention(site, "preregister", "--out", plans, "--model", "tiny-random", "--budget", 40,
              "--treatment", json.dumps(dict(arm, scorer="keynorm", scorer_params={"power": 2})),
              "--baseline", json.dumps(dict(arm, scorer="streaming")), "-k", 1, "--max-new-tokens", 8,
              "--boot", 200, "--boot-max", 200)
    (plan,) = plans.glob("plan-*.json")
    registered = json.loads(plan.read_text())["plan"]["treatment"]["scorer_plugin"]
    assert registered["sources_sha256"] == plugin["sources_sha256"]
    conf = tmp_path / "confirm"
    out = retention(site, "confirm", "--plan", plan, "--out", conf, "--allow-dirty").stdout
    assert "1 cell(s) confirmed" in out

    # the plugin's code changes: resume and confirm are refused, naming what changed
    source = site / "keynorm_scorer" / "__init__.py"
    source.write_text(source.read_text() + "# tuned after registration\n")
    res = retention(site, *common, check=False)
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert "scorer_plugin.sources_sha256.keynorm_scorer/__init__.py differ" in res.stderr
    res = retention(site, "confirm", "--plan", plan, "--out", tmp_path / "confirm2", "--allow-dirty", check=False)
    assert res.returncode == 1 and res.stderr.startswith("Error: ") and res.stderr.count("\n") == 1
    assert "scorer plugin changed since it was registered (scorer_plugin.sources_sha256.keynorm_scorer/__init__.py" \
           in res.stderr


def test_the_example_s_own_tests_pass(site):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
                         capture_output=True, text=True, env=env, cwd=EXAMPLE)
    assert res.returncode == 0, res.stdout + res.stderr


def test_example_scorer_is_at_most_30_lines():
    assert len((EXAMPLE / "keynorm_scorer" / "__init__.py").read_text().splitlines()) <= 30


def test_a_decoding_plugin_runs_checks_preregisters_and_confirms(site, tmp_path):
    """The example's `max-run` (entry-point group retention.decodings) is a mechanism of another
    family: run by its name with a parameter, its identity in the configuration, its family's
    contract kit, a plan whose treatment uses it, and that plan's confirmation."""
    runs = tmp_path / "runs"
    out = retention(site, "run", "--model", "tiny-random", "--scorer", "streaming", "--decoding", "max-run",
                    "--param", "max-run.run=2", "--budget", 40, "--limit", 2, "--max-new-tokens", 12, "--out", runs,
                    "--quiet", "--batch-size", 2, "--temperature", 0).stdout
    (run_dir,) = runs.iterdir()
    assert "2 records" in out
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    assert cfg["decoding"]["name"] == "max-run" and cfg["decoding"]["params"] == {"run": 2}
    assert cfg["decoding"]["plugin"]["distribution"].replace("_", "-") == "keynorm-scorer"
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        toks = json.loads(line)["output_token_ids"]
        assert all(len(set(toks[i:i + 3])) > 1 for i in range(len(toks) - 2))  # no run of 3

    check = retention(site, "check", "decoding:max-run").stdout
    assert "FAIL" not in check and "trivial member exact" in check and "batch invariance" in check

    plans = tmp_path / "plans"
    arm = {"interval": 8, "limit": 2}
    retention(site, "preregister", "--out", plans, "--model", "tiny-random", "--budget", 40,
              "--treatment", json.dumps(dict(arm, scorer="streaming", decoding={"name": "max-run",
                                                                                "params": {"run": 2}})),
              "--baseline", json.dumps(dict(arm, scorer="streaming")), "-k", 1, "--max-new-tokens", 8,
              "--boot", 200, "--boot-max", 200)
    (plan,) = plans.glob("plan-*.json")
    treatment = json.loads(plan.read_text())["plan"]["treatment"]
    assert treatment["decoding"]["name"] == "max-run" and treatment["decoding"]["plugin"]["sources_sha256"]
    out = retention(site, "confirm", "--plan", plan, "--out", tmp_path / "confirm", "--allow-dirty").stdout
    assert "1 cell(s) confirmed" in out
