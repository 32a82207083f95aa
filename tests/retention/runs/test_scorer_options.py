"""Per-scorer parameters: `--param SCORER.NAME=VALUE`, and shared options that cannot collide."""

import pytest
from click.testing import CliRunner

from retention.cli import main
from retention.runs.arms import build_arm_config
from retention.runs.scorer_options import resolve
from retention.errors import RetentionError

BASE = {"model": "tiny-random", "budget": 64, "interval": None, "sink": None, "recent": None, "accounting": "mean"}


def test_qualified_params_reach_only_their_scorer():
    per = resolve(["alpha", "rkv", "h2o"], {}, ("alpha.lam=0.5", "rkv.lam=0.1", "h2o.window=6"))
    assert per == {"alpha": {"lam": 0.5}, "rkv": {"lam": 0.1}, "h2o": {"window": 6}}
    assert isinstance(per["h2o"]["window"], int)
    params = build_arm_config(BASE, "rkv", per["rkv"]).scorer_params
    assert params["lam"] == 0.1


def test_shared_lambda_is_refused_when_it_would_mean_two_things():
    with pytest.raises(RetentionError, match=r"--param alpha.lam=\.\.\. --param rkv.lam=\.\.\."):
        resolve(["alpha", "rkv"], {"--lambda": 0.5})
    # one meaning: --lambda reaches only the scorer that takes it
    assert resolve(["alpha", "triattention"], {"--lambda": 0.3}) == {"alpha": {"lam": 0.3}, "triattention": {}}


@pytest.mark.parametrize("names,shared,params,match", [
    (["alpha"], {"--lambda": 0.5}, ("alpha.lam=0.3",), r"--lambda and --param alpha.lam both set"),
    (["alpha", "rkv"], {"--lambda": 0.5}, ("rkv.lam=0.2",), r"--lambda and --param rkv.lam both set"),
    (["h2o"], {"--window": 8}, ("h2o.window=4",), r"--window and --param h2o.window both set"),
    (["alpha"], {}, ("alpha.lam=0.3", "alpha.lam=0.5"), r"--param alpha.lam is given twice"),
])
def test_contradictions_are_refused_not_resolved_silently(names, shared, params, match):
    with pytest.raises(RetentionError, match=match):
        resolve(names, shared, params)


@pytest.mark.parametrize("names,shared,params,match", [
    (["snapkv"], {"--lambda": 0.5}, (), "--lambda is not a parameter of any listed scorer"),
    (["alpha"], {"--window": 4}, (), "--window is not a parameter"),
    (["snapkv"], {}, ("snapkv.lam=0.5",), "has no parameter 'lam'"),
    (["alpha"], {}, ("rkv.lam=0.5",), "scorer 'rkv' is not listed"),
    (["alpha"], {}, ("lam=0.5",), "expected SCORER.NAME=VALUE"),
    (["alpha"], {}, ("alpha.lam",), "expected SCORER.NAME=VALUE"),
    (["alpha"], {}, ("alpha.lam=high",), "is not a number"),
    (["h2o"], {}, ("h2o.window=2.5",), "is not a whole number"),
])
def test_options_no_listed_scorer_takes_are_errors(names, shared, params, match):
    with pytest.raises(RetentionError, match=match):
        resolve(names, shared, params)


def test_run_refuses_a_colliding_lambda_before_loading_anything(tmp_path):
    out = CliRunner().invoke(main, ["run", "--model", "tiny-random", "--scorer", "alpha,rkv", "--lambda", "0.5",
                                    "--budget", "64", "--out", str(tmp_path / "runs")])
    assert out.exit_code == 1 and "Error: --lambda would set alpha" in out.output
    assert not (tmp_path / "runs").exists()
