"""Report outputs: every row names its dataset and split, each dataset is its own Bonferroni family,
each comparison shows the code version (and model quantisation) of both arms, and a report
killed while writing its folder is marked incomplete."""

from __future__ import annotations

import pytest

from protocol import report
from tests.protocol.test_report import make_run


def _two_datasets(tmp_path):
    for i, extra in enumerate(({}, {"dataset": "aime24"})):
        make_run(tmp_path, scorer="alpha", n=20, shift=0.1, seed=2 * i, extra=extra)
        make_run(tmp_path, scorer="triattention", n=20, seed=2 * i + 1, extra=extra)


def test_a_report_mixing_datasets_names_them_and_tests_each_in_its_own_family(tmp_path):
    _two_datasets(tmp_path)
    rep = report.build_report([tmp_path], boot=200)
    assert sorted(r["dataset"] for r in rep.comparisons) == ["aime24", "math500"]
    assert sorted(a["dataset"] for a in rep.arms) == ["aime24", "aime24", "math500", "math500"]
    assert [r["m"] for r in rep.comparisons] == [1, 1]
    assert sorted(r["test_source"] for r in rep.comparisons) == ["report settings (aime24)",
                                                                "report settings (math500)"]
    text = report.terminal_summary(rep)
    assert "aime24/dev" in text and "math500/dev" in text
    assert "report settings (aime24): cluster bootstrap" in text
    tex = report.to_latex(rep)
    assert "aime24/dev" in tex and "math500/dev" in tex
    csv = (report.write_report(rep, tmp_path / "out")[0]).read_text()
    assert "dataset" in csv.splitlines()[0] and "aime24" in csv


def test_a_given_m_over_two_datasets_is_one_family_and_says_so(tmp_path):
    _two_datasets(tmp_path)
    rep = report.build_report([tmp_path], boot=200, m=2)
    assert {r["test_source"] for r in rep.comparisons} == {"report settings"}
    assert "one Bonferroni family (m=2, --m) spans the datasets aime24, math500" in rep.notes


def test_dev_and_confirm_rows_differ_on_the_console(tmp_path):
    make_run(tmp_path / "d", scorer="alpha", n=10, shift=0.1)
    make_run(tmp_path / "d", scorer="triattention", n=10, seed=1)
    make_run(tmp_path / "c", scorer="alpha", n=10, shift=0.1, split="confirm")
    make_run(tmp_path / "c", scorer="triattention", n=10, seed=1, split="confirm")
    rep = report.build_report([tmp_path], boot=200)
    rows = [line for line in report.terminal_summary(rep).splitlines() if " vs " in line and "alpha" in line
            and not line.startswith(("status", "!!!", "code"))]
    assert len(rows) == 2 and sorted(r.split()[1] for r in rows) == ["math500/confirm", "math500/dev"]


@pytest.mark.parametrize("versions, flag", [
    (("0.1+gabc", "0.1+gabc"), ""),
    (("0.1+gabc", "0.1+gdef"), "different code"),
    (("0.1+gabc-dirty", "0.1+gabc-dirty"), "uncommitted changes"),
    (("0.1+gabc.dirty", "0.1+gdef"), "different code; uncommitted changes"),
])
def test_each_comparison_shows_both_arms_code_versions(tmp_path, versions, flag):
    make_run(tmp_path, scorer="alpha", n=10, shift=0.1, meta_extra={"code_version": versions[0]})
    make_run(tmp_path, scorer="triattention", n=10, seed=1, meta_extra={"code_version": versions[1]})
    rep = report.build_report([tmp_path], boot=200)
    row = rep.comparisons[0]
    assert (row["t_code_version"], row["b_code_version"], row["code_flag"]) == (*versions, flag)
    text = report.terminal_summary(rep)
    assert "[" not in row["verdict"]  # the verdict stays the test's; the code line marks the row
    if flag:
        assert f"treatment {versions[0]}, baseline {versions[1]} <- {flag}" in text
        assert "paragraph{Code.}" in report.to_latex(rep)
    else:
        assert "code: 0.1+gabc (every arm)" in text


def test_a_quantised_model_is_named_in_the_arms_and_rows(tmp_path):
    make_run(tmp_path, scorer="alpha", n=10, shift=0.1, extra={"model_quant": "Q4_K_M"})
    make_run(tmp_path, scorer="triattention", n=10, seed=1, extra={"model_quant": "Q4_K_M"})
    rep = report.build_report([tmp_path], boot=200)
    assert [a["model_quant"] for a in rep.arms] == ["Q4_K_M", "Q4_K_M"]
    assert rep.comparisons[0]["code_flag"] == ""
    text = report.terminal_summary(rep)
    assert text.count("qwen-1.5b (Q4_K_M)") == 3  # two arms, one comparison
    assert r"qwen-1.5b (Q4\_K\_M)" in report.to_latex(rep)
    other = tmp_path / "mixed"
    make_run(other, scorer="alpha", n=10, shift=0.1, extra={"model_quant": "Q4_K_M"})
    make_run(other, scorer="triattention", n=10, seed=1)
    row = report.build_report([other], boot=200).comparisons[0]
    assert row["code_flag"] == "quantisation Q4_K_M vs none"


# --------------------------------------------------------------------------------------------------
# a report killed while writing its folder


def test_a_report_killed_while_writing_is_marked_and_the_rerun_cleans_up(tmp_path, monkeypatch):
    import json

    from protocol import render, report_figures

    runs = tmp_path / "runs"
    make_run(runs, scorer="alpha", n=12, k=1, trace=True)
    make_run(runs, scorer="triattention", n=12, k=1, shift=0.1, seed=1, trace=True)
    out = tmp_path / "rep"
    first = {p.name for p in report.write_report(report.build_report([runs], boot=100), out)}
    assert not (out / "REPORT-INCOMPLETE").exists()
    assert json.loads((out / render.REPORT_LISTING).read_text()) == {"files": sorted(first - {render.REPORT_LISTING})}

    def killed(rep):  # the process dies here: nothing after this point runs
        raise SystemExit(137)

    real = report_figures.render_all
    monkeypatch.setattr(report_figures, "render_all", killed)
    with pytest.raises(SystemExit):
        report.write_report(report.build_report([runs], boot=100), out)
    assert (out / "REPORT-INCOMPLETE").exists()  # new CSVs beside the old PNGs: marked
    listing = json.loads((out / render.REPORT_LISTING).read_text())
    assert listing["complete"] is False and set(first - {render.REPORT_LISTING}) <= set(listing["files"])
    monkeypatch.setattr(report_figures, "render_all", real)
    again = {p.name for p in report.write_report(report.build_report([runs], boot=100), out)}
    assert again == first and {p.name for p in out.iterdir()} == first
