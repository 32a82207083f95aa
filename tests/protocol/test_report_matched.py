"""The report says what matched memory matched (issue 46): a `--budget-bytes` arm is labelled by its
KiB, and every table pairing arms shows the unit matched and both arms' measured tokens and KiB."""

from __future__ import annotations

from protocol import report
from protocol.design_space import design_space_lines
from protocol.render import terminal_summary
from tests.protocol.test_report import make_run


def test_a_kib_arm_is_labelled_by_its_kib_and_the_pair_by_its_unit(tmp_path):
    # 96 tokens x 28 KiB/token = 2688 KiB: the quant arm was given 2688 KiB and matched at 96 tokens.
    make_run(tmp_path, scorer="triattention", budget=96, seed=1)
    make_run(tmp_path, scorer="triattention", budget=96, seed=2, shift=0.1,
             extra={"state": {"name": "quant", "params": {"bits": 4}}, "budget_kib": 2688.0})
    rep = report.build_report([tmp_path], baseline="triattention", boot=200)
    (row,) = rep.comparisons
    text = terminal_summary(rep)
    quant = next(a for a in rep.arms if a["budget_kib"] is not None)
    assert quant["budget_kib"] == 2688.0
    lines = text.splitlines()
    arm_line = next(ln for ln in lines if ln.startswith("triattention+quant"))
    assert "2688 KiB" in arm_line  # never "96", a token figure it did not hold
    header = next(ln for ln in lines if "treatment vs baseline" in ln)
    assert "matched" in header and "cache T" in header and "cache B" in header
    pair = next(ln for ln in lines if "triattention+quant vs triattention" in ln)
    assert "2688 KiB vs 96" in pair and " KiB " in pair
    measured = f"{row['t_cache_mean_tokens']:.1f} tok / {row['t_cache_mean_kib']:.1f} KiB"
    assert measured in pair and f"{row['b_cache_mean_tokens']:.1f} tok / {row['b_cache_mean_kib']:.1f} KiB" in pair
    tex = report.to_latex(rep)
    assert "2688 KiB vs 96" in tex and "& Matched & Cache T & Cache B" in tex and "& KiB & " in tex
    ds = "\n".join(design_space_lines(rep.design_space))
    assert "/2688 KiB vs 96, matched in KiB" in ds


def test_token_arms_are_matched_in_tokens(tmp_path):
    make_run(tmp_path, scorer="triattention", budget=96, seed=1)
    make_run(tmp_path, scorer="triattention", budget=96, seed=2, extra={"state": {"name": "quant", "params": {}}})
    rep = report.build_report([tmp_path], baseline="triattention", boot=200)
    pair = next(ln for ln in terminal_summary(rep).splitlines() if "triattention+quant vs triattention" in ln)
    assert " tokens " in pair and "KiB vs" not in pair
    assert "matched in tokens" in "\n".join(design_space_lines(rep.design_space))
