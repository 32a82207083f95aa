"""The notebook API writes the run directory `retention run` writes, and takes scorer instances."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner

from retention.api import records_frame, run_arm
from retention.cli import main
from retention.errors import RetentionError
from retention.policy.scoring.base import Scorer
from retention.policy.registry import make_scorer

OPTS = dict(budget=40, limit=2, max_new_tokens=10, batch_size=2)
CLI_OPTS = ["--model", "tiny-random", "--budget", "40", "--limit", "2", "--max-new-tokens", "10", "--batch-size", "2",
            "--quiet"]


@dataclass
class NormScorer(Scorer):
    power: float = 1.0

    def score(self, view):
        s = torch.stack([k.norm(dim=-1) for k in view.keys]).mean(0) ** self.power
        return s.masked_fill(~view.valid[0], float("-inf"))


def strip(rec):
    return {k: v for k, v in rec.items() if k not in ("wall_seconds", "tokens_per_second")}


def test_same_run_directory_and_records_as_the_cli(tmp_path):
    recs = run_arm("tiny-random", "h2o", params={"window": 4}, out=tmp_path, **OPTS)
    assert len(recs) == 2 and {r["output_tokens"] for r in recs} == {10}
    (run_dir,) = tmp_path.iterdir()
    first = (run_dir / "records.jsonl").read_text()
    res = CliRunner().invoke(main, ["run", "--scorer", "h2o", "--param", "h2o.window=4", "--out", str(tmp_path),
                                    *CLI_OPTS])
    assert res.exit_code == 0, res.output
    assert [p.name for p in tmp_path.iterdir()] == [run_dir.name]  # the CLI found the API's run and resumed it
    assert (run_dir / "records.jsonl").read_text() == first
    other = tmp_path.parent / "cli_only"
    assert CliRunner().invoke(main, ["run", "--scorer", "h2o", "--param", "h2o.window=4", "--out", str(other),
                                     *CLI_OPTS]).exit_code == 0
    (cli_dir,) = other.iterdir()
    assert cli_dir.name == run_dir.name
    cli_recs = [json.loads(line) for line in (cli_dir / "records.jsonl").read_text().splitlines()]
    assert [strip(r) for r in cli_recs] == [strip(r) for r in recs]


def test_instance_of_an_importable_class_and_the_dataframe(tmp_path):
    recs = run_arm("tiny-random", NormScorer(power=2.0), out=tmp_path, **OPTS)
    (run_dir,) = tmp_path.iterdir()
    cfg = json.loads((run_dir / "config.json").read_text())["config"]
    assert cfg["scorer"] == f"{__name__}:NormScorer" and cfg["scorer_params"] == {"power": 2.0}
    assert cfg["scorer_plugin"]["spec"] == f"{__name__}:NormScorer" and cfg["scorer_plugin"]["sources_sha256"]
    df = records_frame(recs)
    assert len(df) == 2 and {"problem_id", "cache_mean_tokens", "output_tokens"} <= set(df.columns)
    assert (df["cache_mean_tokens"] <= 40).all()


NOTEBOOK_CELL = """
from dataclasses import dataclass
from retention.scorers import Scorer

@dataclass
class Newest(Scorer):
    def score(self, view):
        return view.positions[0].double().masked_fill(~view.valid[0], float("-inf"))
"""


def notebook_class(monkeypatch, source=NOTEBOOK_CELL):
    """A class as a notebook defines it: its module has no file, its source lives in linecache."""
    import linecache
    import sys
    import types

    fname = f"<ipython-input-{abs(hash(source))}>"
    monkeypatch.setitem(linecache.cache, fname, (len(source), None, source.splitlines(True), fname))
    mod = types.ModuleType("__notebook__")
    monkeypatch.setitem(sys.modules, "__notebook__", mod)
    exec(compile(source, fname, "exec"), mod.__dict__)
    return mod.Newest


def test_instance_of_a_class_defined_in_a_notebook(tmp_path, monkeypatch):
    recs = run_arm("tiny-random", notebook_class(monkeypatch)(), out=tmp_path, **OPTS)
    assert len(recs) == 2
    (run_dir,) = tmp_path.iterdir()
    plugin = json.loads((run_dir / "config.json").read_text())["config"]["scorer_plugin"]
    assert plugin["spec"] == "__notebook__:Newest" and list(plugin["sources_sha256"]) == ["__notebook__:Newest"]
    # the cell edited and rerun into the same folder: refused, naming what changed
    changed = notebook_class(monkeypatch, NOTEBOOK_CELL.replace(".double()", ".double().neg()"))
    with pytest.raises(RetentionError, match="sources_sha256.__notebook__:Newest differ"):
        run_arm("tiny-random", changed(), out=tmp_path, **OPTS)


def test_builtin_instance_and_bad_input(tmp_path):
    recs = run_arm("tiny-random", make_scorer("streaming"), out=tmp_path, **OPTS)
    (run_dir,) = tmp_path.iterdir()
    assert len(recs) == 2 and "-streaming-b40-" in run_dir.name
    assert "scorer_plugin" not in json.loads((run_dir / "config.json").read_text())["config"]
    with pytest.raises(RetentionError, match="not also as params"):
        run_arm("tiny-random", make_scorer("streaming"), params={"x": 1}, out=tmp_path, **OPTS)
    with pytest.raises(RetentionError, match="confirm split"):
        run_arm("tiny-random", "streaming", split="confirm", out=tmp_path, **OPTS)
