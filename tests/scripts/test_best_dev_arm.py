"""scripts/best_dev_arm.py: the rule of cell 2 of the 1.5B confirmation, on hand-made arms and on the sweep."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("best_dev_arm", ROOT / "scripts" / "best_dev_arm.py")
best = importlib.util.module_from_spec(spec)
sys.modules["best_dev_arm"] = best  # its dataclass looks its module up there
spec.loader.exec_module(best)


def arm(label, correct, strict, created, scorer=None, rule="evict"):
    return best.Candidate(label, scorer or label, rule, correct, strict, created, f"runs/{label}")


def test_accuracy_then_strict_then_the_sweep_order():
    arms = [arm("triattention", 37, 35, "01"), arm("alpha", 38, 38, "02"), arm("snapkv", 38, 38, "03"),
            arm("h2o", 38, 39, "04"), arm("rkv", 30, 30, "00")]
    assert [c.label for c in best.ranked(arms)] == ["h2o", "alpha", "snapkv", "triattention", "rkv"]


def test_the_control_the_full_cache_and_the_peers_convention_are_not_candidates():
    arms = [arm("full", 50, 50, "01"), arm("random-pp+pp-in", 45, 45, "02", scorer="random-pp"),
            arm("triattention+pp-top", 44, 44, "03", scorer="triattention", rule="keep-on-top"),
            arm("triattention+pp-in", 40, 40, "04", scorer="triattention", rule="keep"),
            arm("triattention", 39, 39, "00")]
    assert [c.label for c in best.ranked(arms)] == ["triattention+pp-in", "triattention"]


def test_an_incomplete_sweep_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        best.main([str(ROOT / "results" / "design-space-qwen1.5b" / "runs"), "--expect", "99"])
    assert "of 99 arms; the rule is applied to the complete sweep" in str(exc.value)


def test_on_the_committed_sweep(capsys):
    folder = ROOT / "results" / "design-space-qwen1.5b" / "runs"
    n = len(best.candidates(folder))
    assert best.main([str(folder), "--expect", str(n)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("chosen: ") and "random-pp" not in out[-1]
