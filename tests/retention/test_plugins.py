"""Scorer plugins: the ways to name one, their identity in the arm, and the errors they can cause
(each one `Error:` line, nothing written lost)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from retention.errors import RetentionError
from retention.plugins import differing_keys
from retention.runs.runner import RecordStore, run_id_for
from retention.policy.registry import get_scorer_class, make_scorer, scorer_identity
from tests.cli import invoke

KEYNORM = (Path(__file__).parents[2] / "examples" / "keynorm-scorer" / "keynorm_scorer" / "__init__.py").read_text()

LATE = '''
from dataclasses import dataclass, field
import os
import torch
from retention.scorers import Scorer

@dataclass
class Late(Scorer):
    """Raises in the second sequence it scores when LATE_FAIL is set."""
    _started: int = field(default=0, init=False)

    def reset_slot(self, slot, seed):
        self._started += 1

    def score(self, view):
        if os.environ.get("LATE_FAIL") and self._started >= 2:
            raise ValueError("late failure")
        return torch.stack([k.norm(dim=-1) for k in view.keys]).mean(0).masked_fill(~view.valid[0], float("-inf"))
'''


def one_error_line(res) -> str:
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: "), res.output
    assert "Traceback" not in res.output
    return lines[0]


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "keynorm.py"
    path.write_text(KEYNORM)
    return path


def run_args(spec, out, *extra):
    return ["run", "--model", "tiny-random", "--scorer", spec, "--budget", 40, "--limit", 2, "--max-new-tokens", 12,
            "--out", out, "--quiet", "--no-grade", "--batch-size", 2, *extra]


def test_file_spec_resolves_and_identifies(plugin_file):
    spec = f"{plugin_file}:KeyNorm"
    cls = get_scorer_class(spec)
    assert cls.name == "keynorm" and make_scorer(spec, power=2.0).power == 2.0
    ident = scorer_identity(spec)
    assert ident["spec"] == spec and ident["distribution"] is None and ident["version"] is None
    import hashlib

    assert ident["sources_sha256"] == {"keynorm.py": hashlib.sha256(plugin_file.read_bytes()).hexdigest()}
    assert scorer_identity("alpha") is None


def test_module_spec_hashes_its_package(tmp_path, monkeypatch):
    pkg = tmp_path / "mylab_scorers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "norms.py").write_text(KEYNORM)
    (pkg / "helpers.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ident = scorer_identity("mylab_scorers.norms:KeyNorm")
    assert set(ident["sources_sha256"]) == {"mylab_scorers/__init__.py", "mylab_scorers/norms.py",
                                            "mylab_scorers/helpers.py"}
    for mod in [m for m in sys.modules if m.startswith("mylab_scorers")]:
        monkeypatch.delitem(sys.modules, mod)


def test_plugin_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_anywhere\n")
    notscorer = tmp_path / "plain.py"
    notscorer.write_text("class Thing:\n    pass\n")
    cases = {f"{bad}:X": "failed to import: ModuleNotFoundError",
             f"{notscorer}:Thing": "is not a retention.scorers.Scorer",
             f"{notscorer}:Nope": "has no 'Nope'", f"{tmp_path}/missing.py:X": "no such file",
             "no_such_pkg.sub:X": "failed to import"}
    for spec, want in cases.items():
        line = one_error_line(invoke(*run_args(spec, tmp_path / "runs")))
        assert f"scorer plugin {spec!r}" in line and want in line, line
    assert not (tmp_path / "runs").exists()


def test_constructor_error_and_param_spellings(plugin_file, tmp_path):
    spec = f"{plugin_file}:KeyNorm"
    line = one_error_line(invoke(*run_args(spec, tmp_path / "runs", "--param", "keynorm.power=-1")))
    assert f"scorer plugin {spec!r}" in line and "power must be > 0" in line
    line = one_error_line(invoke(*run_args(spec, tmp_path / "runs", "--param", "keynorm.nope=1")))
    assert "has no parameter 'nope'" in line
    # by the class's name or by the spec as given: the same arm
    a = invoke(*run_args(spec, tmp_path / "a", "--param", "keynorm.power=2"))
    b = invoke(*run_args(spec, tmp_path / "b", "--param", f"{spec}.power=2"))
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    (da,), (db,) = (tmp_path / "a").iterdir(), (tmp_path / "b").iterdir()
    assert da.name == db.name
    cfg = json.loads((da / "config.json").read_text())["config"]
    assert cfg["scorer_params"] == {"power": 2.0} and cfg["scorer_plugin"]["spec"] == spec


def test_changed_plugin_is_refused_on_resume(plugin_file, tmp_path):
    spec, out = f"{plugin_file}:KeyNorm", tmp_path / "runs"
    assert invoke(*run_args(spec, out)).exit_code == 0
    (run_dir,) = out.iterdir()
    before = (run_dir / "records.jsonl").read_bytes()
    plugin_file.write_text(KEYNORM + "# tuned\n")
    line = one_error_line(invoke(*run_args(spec, out)))
    assert "belongs to another configuration (scorer_plugin.sources_sha256.keynorm.py differ)" in line
    assert list(out.iterdir()) == [run_dir] and (run_dir / "records.jsonl").read_bytes() == before


def test_run_id_ignores_plugin_sources_but_the_hash_does_not():
    base = {"model": "tiny-random", "scorer": "/x/k.py:K", "budget": 40,
            "scorer_plugin": {"spec": "/x/k.py:K", "distribution": None, "version": None,
                              "sources_sha256": {"k.py": "a"}}}
    changed = json.loads(json.dumps(base))
    changed["scorer_plugin"]["sources_sha256"]["k.py"] = "b"
    assert run_id_for(base) == run_id_for(changed) and run_id_for(base).startswith("tiny-random-k.py_K-b40-")
    assert differing_keys(base, changed) == ["scorer_plugin.sources_sha256.k.py"]


def test_record_of_another_configuration_shows_where_hashes_differ(tmp_path):
    path = tmp_path / "records.jsonl"
    theirs, ours = "0affe41622" + "1" * 54, "0affe41622" + "2" * 54
    path.write_text(json.dumps({"config_hash": theirs, "problem_id": "p", "sample": 0}) + "\n")
    with pytest.raises(RetentionError) as err:
        RecordStore(path, ours)
    msg = str(err.value)
    assert f"config_hash {theirs[:16]}, this run is {ours[:16]}" in msg


def test_plugin_raising_during_decoding_stops_cleanly_and_resumes(tmp_path, monkeypatch):
    plugin = tmp_path / "late.py"
    plugin.write_text(LATE)
    spec, out = f"{plugin}:Late", tmp_path / "runs"
    args = ["run", "--model", "tiny-random", "--scorer", spec, "--budget", 40, "--limit", 3, "--max-new-tokens", 20,
            "--batch-size", 1, "--out", out, "--quiet", "--no-grade"]
    monkeypatch.setenv("LATE_FAIL", "1")
    line = one_error_line(invoke(*args))
    assert f"scorer plugin {spec!r} raised during decoding (ValueError: late failure)" in line
    (run_dir,) = out.iterdir()
    kept = (run_dir / "records.jsonl").read_text().splitlines()
    assert len(kept) == 1
    monkeypatch.delenv("LATE_FAIL")
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    lines = (run_dir / "records.jsonl").read_text().splitlines()
    assert len(lines) == 3 and lines[0] == kept[0]


def test_changed_plugin_whose_defaults_change_the_run_id_is_refused_too(plugin_file, tmp_path):
    """A new default sink changes the cadence and so the run id: still refused, not a silent new run."""
    spec, out = f"{plugin_file}:KeyNorm", tmp_path / "runs"
    assert invoke(*run_args(spec, out)).exit_code == 0
    (first,) = out.iterdir()
    plugin_file.write_text(KEYNORM.replace("default_sink = 4", "default_sink = 2"))
    import retention.plugins as plugins  # a new process would import the changed file: forget the old one

    plugins._loaded.clear()
    for mod in [m for m in sys.modules if m.startswith("retention_plugin_")]:
        del sys.modules[mod]
    line = one_error_line(invoke(*run_args(spec, out)))
    assert f"{first} holds a run of scorer plugin {spec!r} from other code" in line
    assert "scorer_plugin.sources_sha256.keynorm.py differ" in line
    assert list(out.iterdir()) == [first]
    assert invoke(*run_args(spec, tmp_path / "new")).exit_code == 0  # a new --out is fine


HELPED = '''
from dataclasses import dataclass

from retention.scorers import Scorer
import keynorm_helper


@dataclass
class Helped(Scorer):
    """Scores through a helper module beside this file."""

    def score(self, view):
        return keynorm_helper.norms(view)
'''

HELPER = '''
import torch


def norms(view):
    return torch.stack([k.norm(dim=-1) for k in view.keys]).mean(0).masked_fill(~view.valid[0], float("-inf"))
'''


def test_a_file_plugin_is_identified_with_the_helper_it_imports(tmp_path, monkeypatch):
    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "helped.py").write_text(HELPED)
    (folder / "keynorm_helper.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "keynorm_helper", raising=False)
    spec, out = f"{folder / 'helped.py'}:Helped", tmp_path / "runs"
    assert set(scorer_identity(spec)["sources_sha256"]) == {"helped.py", "keynorm_helper.py"}
    assert invoke(*run_args(spec, out)).exit_code == 0
    (run_dir,) = out.iterdir()
    before = (run_dir / "records.jsonl").read_bytes()
    (folder / "keynorm_helper.py").write_text(HELPER.replace("mean(0)", "amax(0)"))  # another scorer
    line = one_error_line(invoke(*run_args(spec, out)))
    assert "scorer_plugin.sources_sha256.keynorm_helper.py differ" in line
    assert (run_dir / "records.jsonl").read_bytes() == before
