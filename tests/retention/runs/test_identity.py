"""The canonical form of a plan (retention.runs.identity): one cell however its arms and model are spelled."""

import hashlib
import json
import os

import pytest
from click.testing import CliRunner

from protocol import prereg
from protocol.plans import cell_identity, cell_key
from protocol.splits import manifest_sha256
from retention.cli import main
from retention.models import SPLIT_GGUFS, SplitGGUF, build_tiny_random
from retention.models import aliases as aliases_module

RUNNER = "tests.protocol.test_prereg:cli_runner"


def _cli(args):
    return CliRunner().invoke(main, args)


def _preregister(out, *extra, model="tiny-random", treatment=("scorer=rkv",)):
    sets = [x for t in treatment for x in ("--treatment-set", t)]
    return _cli(["preregister", "--out", str(out), "--model", model, "--budget", "256", *sets,
                 "--baseline-set", "scorer=streaming", "-k", "1", "--max-new-tokens", "16",
                 "--code-version", "0.1.0+gtest", "--runner", RUNNER, *extra])


def _keys(out):
    (path,) = out.glob("plan-*.json")
    plan, _ = prereg.load_plan(path)
    return [cell_key(cell_identity(plan, c)) for c in plan["cells"]], path


def _confirm(plan, out):
    return _cli(["confirm", "--plan", str(plan), "--out", str(out), "--code-version", "0.1.0+gtest"])


@pytest.mark.parametrize("spelling", [
    ("scorer=rkv", "scorer_params.lam=0.1"),  # a default written out
    ("scorer=rkv", "scorer_params.window=8", "scorer_params.kernel=7"),
    ("scorer=rkv", "scorer_params.lambda=0.1"),  # the alias of lam
    ("scorer=rkv", "interval=128"),  # min(128, B) at B = 256: what an absent interval resolves to
])
def test_an_arm_spelled_with_its_defaults_is_the_same_cell(tmp_path, spelling):
    assert _preregister(tmp_path / "a").exit_code == 0
    res = _preregister(tmp_path / "b", treatment=spelling)
    assert res.exit_code == 0, res.output
    assert _keys(tmp_path / "a")[0] == _keys(tmp_path / "b")[0]


def test_a_different_setting_is_a_different_cell(tmp_path):
    assert _preregister(tmp_path / "a").exit_code == 0
    assert _preregister(tmp_path / "b", treatment=("scorer=rkv", "scorer_params.lam=0.2")).exit_code == 0
    assert _keys(tmp_path / "a")[0] != _keys(tmp_path / "b")[0]


def test_a_confirmed_cell_respelled_is_refused(tmp_path):
    assert _preregister(tmp_path / "a").exit_code == 0
    _, plan = _keys(tmp_path / "a")
    res = _confirm(plan, tmp_path / "confirm")
    assert res.exit_code == 0, res.output
    res = _preregister(tmp_path / "b", "--seed", "7", treatment=("scorer=rkv", "scorer_params.lam=0.1",
                                                                 "scorer_params.window=8"))
    assert res.exit_code == 1 and "already confirmed under plan" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_a_baseline_equal_to_the_treatment_spelled_differently_is_refused(tmp_path):
    res = _cli(["preregister", "--out", str(tmp_path), "--model", "tiny-random", "--budget", "256",
                "--treatment-set", "scorer=rkv", "--baseline-set", "scorer=rkv", "--baseline-set",
                "scorer_params.lam=0.1", "-k", "1", "--max-new-tokens", "16"])
    assert res.exit_code == 1 and "identical" in res.output and not list(tmp_path.glob("plan-*"))


def test_a_false_model_revision_is_refused(tmp_path):
    res = _preregister(tmp_path, "--model-revision", "tiny-random=0123abcd")
    assert res.exit_code == 1 and "is not that model's content" in res.output
    assert _preregister(tmp_path, "--model-revision", "tiny-random=random-seed-0").exit_code == 0


@pytest.fixture
def folder(tmp_path):
    model, tok = build_tiny_random(0)
    path = tmp_path / "models" / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_folder_is_one_model_however_it_is_written(tmp_path, folder, monkeypatch):
    os.symlink(folder, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    spellings = [str(folder), f"{folder}/", "models/tiny", "models/../models/tiny", str(tmp_path / "link")]
    keys = []
    for i, name in enumerate(spellings):
        res = _preregister(tmp_path / f"p{i}", model=name)
        assert res.exit_code == 0, res.output
        keys.append(_keys(tmp_path / f"p{i}")[0])
    assert all(k == keys[0] for k in keys)
    plan, _ = prereg.load_plan(_keys(tmp_path / "p1")[1])
    assert plan["cells"][0]["model"] == str(folder.resolve())
    assert len(plan["model_revisions"][str(folder.resolve())]) == 64  # the weights' sha256


def test_a_gguf_file_behind_an_alias_is_the_alias(tmp_path, monkeypatch):
    from tests.retention.models.test_gguf import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = gguf.read_bytes()
    spec = SplitGGUF("tiny-split", "tiny-split-part", 1, "1.0", len(data), hashlib.sha256(data).hexdigest(),
                     (("model_type", "qwen2"), ("num_hidden_layers", 4), ("num_attention_heads", 4),
                      ("num_key_value_heads", 2), ("hidden_size", 64)))
    monkeypatch.setitem(SPLIT_GGUFS, "tiny-split", spec)
    monkeypatch.setitem(aliases_module.ALIASES, "tiny-split", aliases_module.ModelAlias("parts", "tiny-split", "test"))
    os.symlink(gguf, tmp_path / "link.gguf")
    keys = []
    for i, name in enumerate(["tiny-split", str(gguf), str(tmp_path / "link.gguf")]):
        res = _preregister(tmp_path / f"p{i}", model=name)
        assert res.exit_code == 0, res.output
        keys.append(_keys(tmp_path / f"p{i}")[0])
        plan, _ = prereg.load_plan(_keys(tmp_path / f"p{i}")[1])
        assert plan["cells"][0]["model"] == "tiny-split"
    assert keys[0] == keys[1] == keys[2]


def _old_plan(tmp_path, treatment):
    """A plan as `preregister` wrote it before plans were canonical: the arm as the user spelled it."""
    plan = prereg.build_plan(models=["tiny-random"], budgets=[256], treatment=treatment,
                             baseline={"scorer": "streaming"}, k=1, seed=0, max_new_tokens=16,
                             manifest_hash=manifest_sha256(), code_version="0.1.0+gtest", runner=RUNNER)
    path, _, written = prereg.write_plan(prereg.with_cell_stats(plan, {}), tmp_path / "old")
    assert written
    return path


def test_a_plan_registered_before_canonical_plans_still_confirms(tmp_path):
    plan = _old_plan(tmp_path, {"scorer": "rkv", "scorer_params": {"lam": 0.1}})
    res = _confirm(plan, tmp_path / "confirm")
    assert res.exit_code == 0, res.output
    # ...and a canonical plan of that cell is then refused
    res = _preregister(tmp_path / "new", "--seed", "3")
    assert res.exit_code == 1 and "already confirmed under plan" in res.output


def test_an_old_plan_of_a_cell_confirmed_canonically_is_refused(tmp_path):
    assert _preregister(tmp_path / "a").exit_code == 0
    assert _confirm(_keys(tmp_path / "a")[1], tmp_path / "c1").exit_code == 0
    plan = _old_plan(tmp_path, {"scorer": "rkv", "scorer_params": {"window": 8}})
    res = _confirm(plan, tmp_path / "c2")
    assert res.exit_code == 1 and "spelled differently" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "c2").exists()
