"""`retention confirm` and the provenance of what it confirms: a dirty source tree."""

import json

from click.testing import CliRunner

from protocol import prereg
from retention.cli import confirm_cmd, main


def _cli(args):
    return CliRunner().invoke(main, args)


def _plan(tmp_path):
    res = _cli(["preregister", "--out", str(tmp_path), "--model", "tiny-random", "--budget", "256",
                "--treatment-set", "scorer=rkv", "--baseline-set", "scorer=streaming", "-k", "1",
                "--max-new-tokens", "16", "--code-version", "0.1.0+gtest",
                "--runner", "tests.protocol.test_prereg:cli_runner"])
    assert res.exit_code == 0, res.output
    (plan,) = tmp_path.glob("plan-*.json")
    return plan


def _confirm(plan, out, *extra):
    return _cli(["confirm", "--plan", str(plan), "--out", str(out), "--code-version", "0.1.0+gtest",
                 "--runner", "tests.protocol.test_prereg:cli_runner", *extra])


def test_a_dirty_tree_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    monkeypatch.setattr(confirm_cmd, "tree_is_dirty", lambda: True)
    out = tmp_path / "confirm"
    res = _confirm(plan, out)
    assert res.exit_code == 1
    assert res.output.startswith("Error: the source tree has uncommitted changes")
    assert len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_allow_dirty_confirms_with_a_logged_deviation(tmp_path, monkeypatch):
    plan = _plan(tmp_path)
    monkeypatch.setattr(confirm_cmd, "tree_is_dirty", lambda: True)
    out = tmp_path / "confirm"
    res = _confirm(plan, out, "--allow-dirty")
    assert res.exit_code == 0, res.output
    devs = [json.loads(line) for line in prereg.deviations_path(out).read_text().splitlines()]
    assert [d["kind"] for d in devs] == ["dirty_tree"] and devs[0]["cell_id"] == "tiny-random@b256"
    (entry,) = [json.loads(line) for line in prereg.ledger_path(out).read_text().splitlines()]
    assert entry["deviations"] == [devs[0]["hash"]]


def test_a_clean_tree_logs_no_dirty_deviation(tmp_path):
    plan = _plan(tmp_path)
    out = tmp_path / "confirm"
    res = _confirm(plan, out, "--allow-dirty")
    assert res.exit_code == 0, res.output
    path = prereg.deviations_path(out)
    assert not path.exists() or "dirty_tree" not in path.read_text()


RUNNER_CODE = '''
from tests.protocol.test_prereg import FakeRunner


def run(cell, arm, cfg, out_dir):
    return FakeRunner()(cell, arm, cfg, out_dir)
'''


def test_a_registered_runner_whose_code_changed_is_refused(tmp_path, monkeypatch):
    import sys

    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "myrunner.py").write_text(RUNNER_CODE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "myrunner", raising=False)
    res = _cli(["preregister", "--out", str(tmp_path), "--model", "tiny-random", "--budget", "256",
                "--treatment-set", "scorer=rkv", "--baseline-set", "scorer=streaming", "-k", "1",
                "--max-new-tokens", "16", "--code-version", "0.1.0+gtest", "--runner", "myrunner:run"])
    assert res.exit_code == 0, res.output
    (plan,) = tmp_path.glob("plan-*.json")
    assert set(prereg.load_plan(plan)[0]["runner_sources"]) == {"myrunner.py"}
    (folder / "myrunner.py").write_text(RUNNER_CODE + "# now it does something else\n")
    out = tmp_path / "confirm"
    res = _cli(["confirm", "--plan", str(plan), "--out", str(out), "--code-version", "0.1.0+gtest"])
    assert res.exit_code == 1 and "the registered runner myrunner:run changed since registration" in res.output
    assert "runner_sources.myrunner.py differ" in res.output and not out.exists()
    (folder / "myrunner.py").write_text(RUNNER_CODE)  # as registered: confirms
    res = _cli(["confirm", "--plan", str(plan), "--out", str(out), "--code-version", "0.1.0+gtest"])
    assert res.exit_code == 0, res.output


def test_missing_model_parts_are_refused_before_the_cell_is_started(tmp_path):
    """A plan on a split-GGUF model whose weight parts are not installed: one error line naming the
    install command, and neither a crash deviation nor a "started" cell in the registry."""
    import pytest

    from protocol import ledger
    from retention.errors import RetentionError
    from retention.models.gguf import require_weights

    try:
        require_weights("qwen2.5-coder-1.5b")
        pytest.skip("the qwen2.5-coder-1.5b weight parts are installed here: nothing is missing to refuse")
    except RetentionError:
        pass
    res = _cli(["preregister", "--out", str(tmp_path), "--model", "qwen2.5-coder-1.5b", "--budget", "128",
                "--treatment-set", "scorer=rkv", "--baseline-set", "scorer=streaming", "-k", "1",
                "--max-new-tokens", "16", "--code-version", "0.1.0+gtest"])
    assert res.exit_code == 0, res.output
    (plan,) = tmp_path.glob("plan-*.json")
    out = tmp_path / "confirm"
    res = _cli(["confirm", "--plan", str(plan), "--out", str(out), "--code-version", "0.1.0+gtest", "--allow-dirty"])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "needs its weight parts" in lines[0] and "pip install" in lines[0], res.output
    assert not out.exists()
    from protocol.plans import cell_identity, cell_key

    doc, _ = prereg.load_plan(plan)
    (cell,) = doc["cells"]
    assert ledger.Registry().cell_attempts(cell_key(cell_identity(doc, cell))) == []
