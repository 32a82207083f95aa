"""The contract kit: every built-in scorer passes it; each deliberately broken scorer fails it on the
check that names its fault (and `check-scorer` exits 1)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from click.testing import CliRunner

from retention.cli import main
from retention.contract import run_checks
from retention.policy.scoring.base import Scorer, topk_keep
from retention.policy.registry import available

HERE = "tests.retention.contract.test_checks"


def _norms(view):
    return torch.stack([k.norm(dim=-1) for k in view.keys]).mean(0)  # [B, G, n]


@dataclass
class KeepsPadding(Scorer):
    """Scores padding highest and selects without the valid mask."""

    def score(self, view):
        return _norms(view).masked_fill(~view.valid[0], 1e9)

    def select(self, scores, view, k):
        protected, _ = self.masks(view)
        return topk_keep(scores, protected, k)


@dataclass
class WritesIntoView(Scorer):
    """Scores like streaming (by position), then zeroes the keys and values it was shown."""

    def score(self, view):
        scores = view.positions[0].float().masked_fill(~view.valid[0], float("-inf"))
        for k, v in zip(view.keys, view.values):
            k.zero_()
            v.zero_()
        return scores


@dataclass
class KeepsTooMany(Scorer):
    def score(self, view):
        return _norms(view).masked_fill(~view.valid[0], float("-inf"))

    def select(self, scores, view, k):
        return super().select(scores, view, k + 1)


@dataclass
class IgnoresProtected(Scorer):
    """Keeps the newest tokens only, evicting the sinks it is told to protect."""

    default_sink = 4

    def score(self, view):
        return view.positions[0].double().masked_fill(~view.valid[0], float("-inf"))

    def select(self, scores, view, k):
        return torch.sort(torch.topk(scores, k, dim=-1).indices, dim=-1).values


@dataclass
class Nondeterministic(Scorer):
    def score(self, view):
        return torch.rand(view.keys[0].shape[:3], dtype=torch.float64).masked_fill(~view.valid[0], float("-inf"))


@dataclass
class BatchDependent(Scorer):
    """Ranks by key norm alone, by reversed key norm in a batch: deterministic, not batch invariant."""

    def score(self, view):
        s = _norms(view) * (1 if view.keys[0].shape[0] == 1 else -1)
        return s.masked_fill(~view.valid[0], float("-inf"))


@dataclass
class ObserveSyncs(Scorer):
    """Reads a value on the host in every forward."""

    def observe(self, cache, next_position):
        self.last = cache.layers[0].keys.sum().item()

    def score(self, view):
        return _norms(view).masked_fill(~view.valid[0], float("-inf"))


def failing(results):
    return {r.name for r in results if r.ok is False}


@pytest.mark.parametrize("name", available())
def test_builtin_scorers_pass(name):
    results = run_checks(name, share=False)
    assert not failing(results), [r.line() for r in results if r.ok is False]
    assert len(results) == 13  # every check ran (the share figure is off), bytes recounted and decoding output too


@pytest.mark.parametrize("cls,check", [
    ("KeepsPadding", "padding never kept"),
    ("KeepsTooMany", "kept count"),
    ("IgnoresProtected", "protected tokens kept"),
    ("Nondeterministic", "determinism"),
    ("BatchDependent", "batch invariance"),
    ("ObserveSyncs", "host reads per token"),
    ("WritesIntoView", "view unchanged"),
])
def test_broken_scorers_fail_the_right_check(cls, check):
    results = run_checks(f"{HERE}:{cls}", share=False)
    assert check in failing(results), [r.line() for r in results]


def test_batch_dependent_is_still_deterministic():
    """The checks tell faults apart: a batch-dependent scorer passes determinism and padding (it fails
    resume too: a resumed run refills other slots)."""
    bad = failing(run_checks(f"{HERE}:BatchDependent", share=False))
    assert "batch invariance" in bad and not bad & {"determinism", "padding never kept", "kept count"}


def test_cli_exit_status_and_share_figure():
    ok = CliRunner().invoke(main, ["check-scorer", "streaming", "--context", "256", "--share-budget", "64",
                                   "--share-tokens", "16"])
    assert ok.exit_code == 0, ok.output
    assert "INFO compaction share:" in ok.output and "streaming: 13/13 checks pass" in ok.output
    bad = CliRunner().invoke(main, ["check-scorer", f"{HERE}:KeepsTooMany", "--context", "0"])
    assert bad.exit_code == 1 and "FAIL kept count" in bad.output


def test_cli_plugin_that_does_not_import_is_one_error_line():
    r = CliRunner().invoke(main, ["check-scorer", "no_such_pkg.mod:X"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [r.output.strip()]
    assert "scorer plugin 'no_such_pkg.mod:X'" in r.output and "Traceback" not in r.output


@dataclass
class Powered(Scorer):
    """Key norm to a power."""

    name = "powered"
    power: float = 1.0

    def score(self, view):
        return (_norms(view) ** self.power).masked_fill(~view.valid[0], float("-inf"))


def test_cli_params_reach_the_scorer_by_spec_or_by_name():
    spec = f"{HERE}:Powered"
    for param in (f"{spec}.power=2", "powered.power=2"):
        ok = CliRunner().invoke(main, ["check-scorer", spec, "--param", param, "--context", "0"])
        assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["check-scorer", spec, "--param", "powered.nope=1", "--context", "0"])
    assert bad.exit_code == 1 and "scorer 'tests.retention.contract.test_checks:Powered' has no parameter 'nope'" in bad.output
    bad = CliRunner().invoke(main, ["check-scorer", spec, "--param", "powered.power=0", "--param", f"{spec}.power=1"])
    assert bad.exit_code == 1 and "is given twice" in bad.output


def test_a_scorer_writing_into_its_view_is_named_and_leaves_the_cache_intact():
    results = {r.name: r for r in run_checks(f"{HERE}:WritesIntoView", share=False)}
    assert results["view unchanged"].ok is False
    assert "score wrote into its view: keys[0], keys[1]" in results["view unchanged"].detail
    # the view is a copy: the decode is the one of a scorer that only reads (streaming's scores)
    assert results["batch invariance"].ok and results["determinism"].ok
