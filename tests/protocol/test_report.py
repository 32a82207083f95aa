"""Reports: loading and pairing run directories, tables, LaTeX, figures, diagnostics, CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from protocol import report
from protocol.io import config_hash
from protocol.errors import ProtocolError

# --------------------------------------------------------------------------------------------------
# synthetic run directories (also used by test_prereg)


def make_run(root, *, model="qwen-1.5b", scorer="alpha", budget=512, accounting="mean",
             params=None, n=60, k=2, shift=0.0, seed=0, trace=False, fidelity=None,
             split="dev", extra=None, meta_extra=None, verdicts=True) -> Path:
    """Write a run directory following docs/records.md with seeded 0/1 verdicts.

    Problem i has difficulty base[i] shared by every run (so arms are correlated, as in real
    paired runs); `shift` moves this run's success probability; `fidelity` sets mean KL."""
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(123).uniform(0.2, 0.8, n)
    cfg = {"model": model, "model_revision": "rev-1", "scorer": scorer,
           "scorer_params": params or {}, "budget": budget, "accounting": accounting,
           "samples": k, "seed": 0, "split": split, "max_new_tokens": 4096, **(extra or {})}
    digest = config_hash(cfg)  # as `run` hashes it: report checks
    run_id = f"{model}-{scorer}-b{budget}-{digest[:10]}"
    d = Path(root) / run_id
    d.mkdir(parents=True)
    meta = {"run_id": run_id, "config_hash": digest, "config": cfg, "code_version": "test",
            **(meta_extra or {})}
    (d / "config.json").write_text(json.dumps(meta))
    fill = 0.9 if accounting == "mean" else 1.3
    with open(d / "records.jsonl", "w") as fh:
        for i in range(n):
            for j in range(k):
                length = int(rng.integers(200, 2000))
                rec = {"config_hash": digest, "problem_id": f"algebra/{i}.json", "sample": j,
                       "seed": 1000 * i + j, "output_tokens": length,
                       "finish_reason": "length" if length > 1900 else "eos",
                       "cache_mean_tokens": budget * fill, "cache_peak_tokens": int(budget * fill) + 32,
                       "kib_per_token": 28.0, "cache_mean_kib": 28.0 * budget * fill,
                       "budget": budget, "accounting": accounting,
                       "budget_exceeded": accounting == "prefill", "gold": "1",
                       "text": "\\boxed{1}"}
                if verdicts:
                    rec["verdict"] = bool(rng.random() < np.clip(base[i] + shift, 0, 1))
                if fidelity is not None:
                    rec["fidelity"] = {"kl_mean": fidelity, "kl_max": 2 * fidelity,
                                       "top1_agreement": 1 - fidelity, "first_divergence_step": 5}
                fh.write(json.dumps(rec) + "\n")
    if trace:
        with open(d / "trace.jsonl", "w") as fh:
            for i in range(n):
                for j in range(k):
                    steps = np.arange(0, int(rng.integers(300, 900)), 10)
                    tokens = np.minimum(100 + steps, budget * fill + (steps % 64))
                    fh.write(json.dumps({"problem_id": f"algebra/{i}.json", "sample": j,
                                         "steps": steps.tolist(), "tokens": tokens.tolist()}) + "\n")
    return d


def _records(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]


def _write_records(d: Path, recs) -> None:
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def edit_config(d: Path, **changes) -> None:
    """Change a run's configuration as if `run` had written it so: the configuration hash of
    config.json and of every record follows (report refuses a configuration that does not hash to it)."""
    meta = json.loads((d / "config.json").read_text())
    meta["config"].update(changes)
    meta["config_hash"] = config_hash(meta["config"])
    (d / "config.json").write_text(json.dumps(meta))
    _write_records(d, [dict(r, config_hash=meta["config_hash"][:len(r["config_hash"])]) for r in _records(d)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two budgets x (triattention, alpha under mean and prefill, h2o under mean)."""
    root = tmp_path_factory.mktemp("runs")
    seed = 0
    for budget in (256, 1024):
        for scorer, shift, fid in (("triattention", 0.0, 0.3), ("alpha", 0.1, 0.2), ("h2o", -0.05, 0.5)):
            for acct in ("mean", "prefill"):
                if acct == "prefill" and scorer == "h2o":
                    continue
                seed += 1
                make_run(root, model="qwen_1.5b", scorer=scorer, budget=budget, accounting=acct,
                         shift=shift + budget / 10_000, seed=seed, trace=True,
                         fidelity=fid + 10 / budget)
    return root


@pytest.fixture(scope="module")
def built(runs, tmp_path_factory):
    rep = report.build_report([runs], boot=1000, seed=1)
    out = tmp_path_factory.mktemp("report")
    written = report.write_report(rep, out)
    return rep, out, written


# --------------------------------------------------------------------------------------------------
# loading and pairing


def test_comparisons_pair_each_treatment_with_the_triattention_baseline(built):
    rep, _, _ = built
    rows = rep.comparisons
    assert len(rows) == 2 * 3  # per budget: alpha/mean, alpha/prefill, h2o/mean
    assert {r["baseline"] for r in rows} == {"triattention"}
    for r in rows:
        # each treatment is compared with the baseline run of its own accounting mode
        assert r["b_accounting"] == r["t_accounting"] == r["accounting"]
        assert r["delta_pp"] == pytest.approx(100 * (r["acc_treatment"] - r["acc_baseline"]))
        assert r["ci95_lo_pp"] <= r["delta_pp"] <= r["ci95_hi_pp"]
        assert r["ci_bonf_lo_pp"] <= r["ci95_lo_pp"] and r["ci95_hi_pp"] <= r["ci_bonf_hi_pp"]
        assert r["p_bonferroni"] == pytest.approx(min(1.0, r["m"] * r["p_bootstrap"]))
        assert r["p_bootstrap"] <= r["p_holm"] <= r["p_bonferroni"] + 1e-15
        assert (r["n"], r["k"], r["m"]) == (60, 2, 6)


def test_accuracy_matches_the_records(built, runs):
    rep, _, _ = built
    for arm in rep.arms:
        recs = _records(Path(arm["path"]))
        assert arm["accuracy"] == pytest.approx(np.mean([r["verdict"] for r in recs]))
        assert arm["truncation_rate"] == pytest.approx(
            np.mean([r["finish_reason"] == "length" for r in recs]))
        assert arm["budget_exceeded"] == sum(r["budget_exceeded"] for r in recs)
        assert arm["mean_output_tokens"] == pytest.approx(np.mean([r["output_tokens"] for r in recs]))


def test_pair_runs_refuses_missing_rows_and_seed_mismatch(tmp_path):
    t = make_run(tmp_path / "t", scorer="alpha", n=10)
    b = make_run(tmp_path / "b", scorer="triattention", n=10)
    recs = _records(t)
    _write_records(t, recs[:-1])
    with pytest.raises(ProtocolError, match="not paired"):
        report.pair_runs(report.load_run(t), report.load_run(b))
    recs[0]["seed"] = 999_999
    _write_records(t, recs)
    with pytest.raises(ProtocolError, match="different seeds"):
        report.pair_runs(report.load_run(t), report.load_run(b))


def test_failed_and_ungradable_generations_count_as_wrong(tmp_path):
    t = make_run(tmp_path / "t", scorer="alpha", n=4, k=1)
    recs = _records(t)
    for r in recs:
        r["verdict"] = True
    recs[0]["verdict"] = None  # ungradable
    _write_records(t, recs)
    run = report.load_run(t)
    assert report.summarize_run(run)["accuracy"] == pytest.approx(0.75)


def test_missing_verdicts_are_graded_with_the_grader(tmp_path):
    from types import SimpleNamespace

    t = make_run(tmp_path / "t", scorer="alpha", n=5, k=1, verdicts=False)
    recs = _records(t)
    recs[1]["gold"] = None  # no gold answer: cannot be graded right
    recs[2]["text"] = "the answer is \\boxed{2}"
    _write_records(t, recs)
    calls = []

    def fake_grade(text, gold):
        calls.append((text, gold))
        ok = text.endswith("{1}") and gold == "1"
        return SimpleNamespace(extracted=text[-2], verdict=ok, reason=None, rule="boxed")

    run = report.load_run(t, grade=fake_grade)
    assert len(calls) == 4
    assert [r["verdict"] for r in run.records] == [True, None, False, True, True]
    assert (t / "records.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in recs)


def test_half_written_last_line_dropped_but_corrupt_middle_line_refused(tmp_path):
    t = make_run(tmp_path / "t", n=3, k=1)
    text = (t / "records.jsonl").read_text()
    (t / "records.jsonl").write_text(text + '{"problem_id": "x", "sam')
    run = report.load_run(t)
    assert len(run.records) == 3 and run.warnings
    (t / "records.jsonl").write_text('{"broken\n' + text)
    with pytest.raises(ProtocolError, match="unreadable"):
        report.load_run(t)


def test_baseline_selection(tmp_path):
    a = make_run(tmp_path, scorer="alpha", n=8)
    make_run(tmp_path, scorer="h2o", n=8, seed=2)
    rep = report.build_report([tmp_path], boot=200)
    first = report.find_run_dirs([tmp_path])[0]  # no triattention run: the first run is baseline
    assert rep.comparisons[0]["baseline_run"] == report.load_run(first).run_id == a.name
    rep = report.build_report([tmp_path], baseline="alpha", boot=200)
    assert rep.comparisons[0]["baseline"] == "alpha" and rep.comparisons[0]["treatment"] == "h2o"
    rep = report.build_report([tmp_path], baseline=str(a), boot=200)
    assert rep.comparisons[0]["baseline_run"] == a.name
    with pytest.raises(ProtocolError, match="matches no run"):
        report.build_report([tmp_path], baseline="nonesuch", boot=200)


def test_labels_tell_parameter_variants_apart(tmp_path):
    make_run(tmp_path, scorer="triattention", n=8)
    make_run(tmp_path, scorer="alpha", params={"lambda": 0.5, "window": 8}, n=8, seed=2)
    make_run(tmp_path, scorer="alpha", params={"lambda": 1.0, "window": 8}, n=8, seed=3)
    rep = report.build_report([tmp_path], boot=200)
    assert sorted(r["treatment"] for r in rep.comparisons) == ["alpha[lambda=0.5]", "alpha[lambda=1.0]"]


def test_the_prompt_rule_is_its_own_arm_and_shown(tmp_path):
    """A run with --protect-prompt (the reference implementations' prompt rule) is not pooled with
    the same scorer under this project's rule, and its label says which rule ran."""
    make_run(tmp_path, scorer="triattention", n=8)
    make_run(tmp_path, scorer="triattention", n=8, seed=2, extra={"protect_prompt": True})
    rep = report.build_report([tmp_path], boot=200)
    assert sorted(a["label"] for a in rep.arms) == ["triattention", "triattention+pp"]
    for baseline in (None, "triattention"):  # a bare name means this project's rule, not the variant
        rep = report.build_report([tmp_path], boot=200, baseline=baseline)
        assert [(c["treatment"], c["baseline"]) for c in rep.comparisons] == [("triattention+pp", "triattention")]


# --------------------------------------------------------------------------------------------------
# outputs


def test_csv_round_trips_through_pandas(built):
    rep, out, _ = built
    df = pd.read_csv(out / "report.csv")
    expected = pd.DataFrame(rep.comparisons)
    assert list(df.columns) == list(expected.columns)
    assert len(df) == len(expected)
    for col in ("delta_pp", "p_bootstrap", "p_bonferroni", "ci95_lo_pp", "t_cache_mean_tokens"):
        assert np.allclose(df[col].to_numpy(float), expected[col].to_numpy(float), rtol=1e-12)
    assert (df["verdict"] == expected["verdict"]).all()
    arms = pd.read_csv(out / "arms.csv")
    assert len(arms) == len(rep.arms) == 10


def _strip_escaped(tex: str) -> str:
    return re.sub(r"\\[{}%&$#_]", "", tex)


def test_latex_uses_booktabs_only_and_is_balanced(built):
    rep, out, _ = built
    tex = (out / "report.tex").read_text()
    assert "\\hline" not in tex and "\\cline" not in tex
    assert tex.count("\\toprule") == tex.count("\\bottomrule") == tex.count("\\midrule") >= 4
    body = _strip_escaped(tex)
    depth = 0
    for ch in body:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0
    assert depth == 0
    stack = []
    for kind, env in re.findall(r"\\(begin|end)\{(\w+)\}", tex):
        if kind == "begin":
            stack.append(env)
        else:
            assert stack and stack.pop() == env
    assert not stack
    assert "qwen\\_1.5b" in tex  # underscores escaped
    # every data row of a tabular has as many cells as its column spec
    for spec, rows in re.findall(r"\\begin\{tabular\}\{(\w+)\}(.*?)\\end\{tabular\}", tex, re.S):
        for line in rows.splitlines():
            if line.endswith("\\\\"):
                assert len(re.split(r"(?<!\\)&", line)) == len(spec)


def test_pngs_written_and_non_empty(built):
    import matplotlib.image as mpimg

    _, out, written = built
    names = {p.name for p in written}
    assert {"accuracy_vs_cache.png", "cache_trace.png", "effect_vs_n.png"} <= names
    for name in ("accuracy_vs_cache.png", "cache_trace.png", "effect_vs_n.png", "proxy_vs_accuracy.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        img = mpimg.imread(out / name)
        assert img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01  # not a blank canvas


def test_report_json_is_strict_json(built):
    _, out, _ = built
    doc = json.loads((out / "report.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert len(doc["comparisons"]) == 6


# --------------------------------------------------------------------------------------------------
# diagnostics


def test_iso_cache_diagnostic(built):
    rep, out, _ = built
    rows = rep.accounting
    assert len(rows) == 2  # alpha vs triattention under both modes, per budget
    by = {(r["accounting"], r["budget"]): r for r in rep.comparisons if r["treatment"] == "alpha"}
    for row in rows:
        assert row["delta_prefill_pp"] == by[("prefill", row["budget"])]["delta_pp"]
        assert row["delta_mean_pp"] == by[("mean", row["budget"])]["delta_pp"]
        assert row["cache_prefill"] > row["cache_mean"]
    assert pd.read_csv(out / "diag_accounting.csv").shape[0] == 2


def test_effect_vs_n_on_nested_subsets(built):
    rep, _, _ = built
    assert report.subset_sizes(60) == [25, 50, 60]
    assert report.subset_sizes(299) == [25, 50, 100, 200, 299]
    for cmp_row in rep.comparisons:
        sub = [r for r in rep.subsets if r["treatment"] == cmp_row["treatment"]
               and r["budget"] == cmp_row["budget"] and r["accounting"] == cmp_row["accounting"]]
        assert [r["n"] for r in sub] == [25, 50, 60]
        assert 100 * sub[-1]["estimate"] == pytest.approx(cmp_row["delta_pp"])


def test_nested_subsets_are_nested():
    from protocol import stats

    rng = np.random.default_rng(0)
    data = stats.PairedData(np.arange(120), rng.integers(0, 3, 120), rng.integers(0, 3, 120), 2)
    rows = report.effect_vs_n(data, seed=5, boot=100)
    order = np.random.default_rng(5).permutation(120)
    for row in rows:
        idx = order[: row["n"]]
        assert row["estimate"] == pytest.approx((data.a[idx] - data.b[idx]).sum() / (2 * row["n"]))


def test_proxy_agreement(built):
    from scipy.stats import spearmanr

    rep, _, _ = built
    assert len(rep.proxy) == 10
    corr = {c["proxy"]: c for c in rep.proxy_corr}
    kl = [p["kl_mean"] for p in rep.proxy]
    acc = [p["accuracy"] for p in rep.proxy]
    assert corr["kl_mean"]["spearman_rho"] == pytest.approx(spearmanr(kl, acc)[0])
    assert corr["kl_mean"]["n_configs"] == 10


def test_no_fidelity_no_proxy_table(tmp_path):
    make_run(tmp_path, scorer="triattention", n=8)
    make_run(tmp_path, scorer="alpha", n=8, seed=2)
    rep = report.build_report([tmp_path], boot=200)
    assert rep.proxy == [] and rep.proxy_corr == [] and rep.accounting == []


def test_aggregate_trace_handles_unequal_lengths():
    agg = report.aggregate_trace([{"steps": [0, 10], "tokens": [5, 15]},
                                  {"steps": [0, 20], "tokens": [5, 25]}], points=3)
    assert agg["grid"] == [0.0, 10.0, 20.0]
    assert agg["alive"] == [2, 2, 1]
    assert agg["mean"] == pytest.approx([5.0, 15.0, 25.0])


def test_trace_band_matches_nanpercentile():
    rng = np.random.default_rng(0)
    trace = []
    for length in rng.integers(20, 200, 30):
        steps = list(range(0, int(length), 5))
        trace.append({"steps": steps, "tokens": list(rng.normal(100, 10, len(steps)))})
    agg = report.aggregate_trace(trace, points=50)
    grid = np.asarray(agg["grid"])
    mat = np.full((len(trace), grid.size), np.nan)
    for i, t in enumerate(trace):
        inside = grid <= t["steps"][-1]
        mat[i, inside] = np.interp(grid[inside], t["steps"], t["tokens"])
    assert np.allclose(agg["lo"], np.nanpercentile(mat, 10, axis=0))
    assert np.allclose(agg["hi"], np.nanpercentile(mat, 90, axis=0))
    assert np.allclose(agg["mean"], np.nanmean(mat, axis=0))


# --------------------------------------------------------------------------------------------------
# CLI


def _cli(args):
    from retention.cli import main

    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_cli_report(runs, tmp_path):
    res = _cli(["report", str(runs), "--out", str(tmp_path / "rep"), "--boot", "500", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "alpha vs triattention" in res.output and "iso-cache" in res.output
    assert "Spearman" in res.output
    assert (tmp_path / "rep" / "report.tex").is_file()


def test_cli_report_bad_input_leaves_existing_files_alone(built, tmp_path):
    _, out, _ = built
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _cli(["report", str(empty), "--out", str(out)])
    assert res.exit_code != 0 and res.output.startswith("Error:")
    assert len(res.output.strip().splitlines()) == 1
    lonely = tmp_path / "lonely"
    make_run(lonely, n=5)
    res = _cli(["report", str(lonely), "--out", str(out)])
    assert res.exit_code != 0 and "at least two runs" in res.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_report_out_removes_files_of_an_earlier_report_only(tmp_path):
    runs = tmp_path / "runs"
    make_run(runs, scorer="alpha", n=12, k=1, trace=True)
    make_run(runs, scorer="triattention", n=12, k=1, shift=0.1, seed=1, trace=True)
    out = tmp_path / "rep"
    out.mkdir()
    (out / "mine.txt").write_text("user file")
    first = {p.name for p in report.write_report(report.build_report([runs], boot=100), out)}
    (out / "stale-figure.png").write_bytes(b"x")
    listing = json.loads((out / report.REPORT_LISTING).read_text())
    listing["files"].append("stale-figure.png")
    (out / report.REPORT_LISTING).write_text(json.dumps(listing))
    second = {p.name for p in report.write_report(report.build_report([runs], boot=100), out)}
    assert first == second
    assert not (out / "stale-figure.png").exists() and (out / "mine.txt").read_text() == "user file"


def test_mechanisms_of_other_families_are_treatments_of_the_plain_baseline(tmp_path):
    """triattention+quant and triattention+loop-guard share the baseline's scorer but not its arm:
    each is compared with the plain triattention run, and the design-space table names the family."""
    from protocol.report import build_report

    make_run(tmp_path, scorer="triattention", seed=1)
    make_run(tmp_path, scorer="triattention", seed=2, shift=0.1,
             extra={"state": {"name": "quant", "params": {"bits": 4}}})
    make_run(tmp_path, scorer="triattention", seed=3, extra={"decoding": {"name": "loop-guard", "params": {}}})
    rep = build_report([tmp_path], baseline="triattention", boot=500)
    assert sorted((r["treatment"], r["baseline"]) for r in rep.comparisons) == [
        ("triattention+loop-guard", "triattention"), ("triattention+quant", "triattention")]
    assert sorted(r["families"] for r in rep.design_space) == ["decoding", "state"]


def test_the_design_space_table_carries_the_iso_cache_diagnostic(tmp_path):
    """The same state mechanism under `prefill` accounting rides along its mean-accounting row (Δ and p
    from the prefill comparison itself), and a row without a prefill run says it was not run."""
    from protocol.design_space import design_space_lines
    from protocol.report import build_report

    quant = {"state": {"name": "quant", "params": {"bits": 4}}}
    make_run(tmp_path, scorer="triattention", seed=1)
    make_run(tmp_path, scorer="triattention", seed=2, shift=0.1, extra=quant)
    make_run(tmp_path, scorer="triattention", seed=3, accounting="prefill")
    make_run(tmp_path, scorer="triattention", seed=4, shift=0.3, accounting="prefill", extra=quant)
    make_run(tmp_path, scorer="triattention", seed=5, extra={"decoding": {"name": "loop-guard", "params": {}}})
    rep = build_report([tmp_path], baseline="triattention", boot=500)
    by = {(r["treatment"], r["accounting"]): r for r in rep.comparisons}
    rows = {r["treatment"]: r for r in rep.design_space}
    assert sorted(rows) == ["triattention+loop-guard", "triattention+quant"]  # the prefill row rides along
    pre = by[("triattention+quant", "prefill")]
    q = rows["triattention+quant"]
    assert q["accounting"] == "mean" and q["delta_pp"] == by[("triattention+quant", "mean")]["delta_pp"]
    assert q["iso_prefill_delta_pp"] == pre["delta_pp"] and q["iso_prefill_p"] == pre["p_bootstrap"]
    assert rows["triattention+loop-guard"]["iso_prefill_delta_pp"] is None
    lines = "\n".join(design_space_lines(rep.design_space))
    assert f"iso-cache (prefill): Δ {pre['delta_pp']:+.2f} pp" in lines and "iso-cache (prefill): not run" in lines


def test_the_design_space_table_shows_the_padding_of_an_allocating_routing(tmp_path):
    """A routing whose heads keep different counts pads this engine's buffers: the row carries the
    metered buffer slots of both arms, and the terminal line shows them only when they exceed the
    stored tokens (records written before the reading existed give NaN, not a figure)."""
    from protocol.design_space import design_space_lines

    base = make_run(tmp_path, scorer="triattention", seed=1)
    ada = make_run(tmp_path, scorer="triattention", seed=2, extra={"routing": {"name": "adakv", "params": {}}})
    for d, pad in ((base, 0.0), (ada, 96.0)):
        _write_records(d, [dict(r, cache_mean_buffer_tokens=r["cache_mean_tokens"] + pad) for r in _records(d)])
    rep = report.build_report([tmp_path], baseline="triattention", boot=200)
    (row,) = rep.design_space
    stored = [a["cache_mean_tokens"] for a in rep.arms if a["run_id"] == ada.name][0]
    assert row["families"] == "routing"
    assert row["t_cache_mean_buffer_tokens"] == pytest.approx(stored + 96.0)
    assert row["b_cache_mean_buffer_tokens"] == pytest.approx(row["b_cache_mean_tokens"])
    assert "buffers " in "\n".join(design_space_lines(rep.design_space))
    _write_records(ada, [dict(r, cache_mean_buffer_tokens=r["cache_mean_tokens"]) for r in _records(ada)])
    rep = report.build_report([tmp_path], baseline="triattention", boot=200)
    assert "buffers " not in "\n".join(design_space_lines(rep.design_space))


def test_a_bare_scorer_baseline_is_the_run_with_every_other_family_at_its_default(tmp_path):
    """`--baseline triattention` beside triattention variants of other families (an allocating routing
    gives plain TriAttention's label its routing parameter) names the plain run, whatever order the
    run directories come in; without --baseline the default rule picks it too."""
    runs = {}
    for seed, extra in enumerate([{"cadence": {"name": "newline", "params": {"max_wait": 32}}},
                                  {"decoding": {"name": "loop-guard", "params": {}}},
                                  {"state": {"name": "merge", "params": {}}}, None], start=1):
        runs[seed] = make_run(tmp_path, scorer="triattention", seed=seed, extra=extra, n=12, k=1,
                              params={"routing": "shared"})
    make_run(tmp_path, scorer="triattention", seed=9, n=12, k=1,
             params={"routing": "per-layer"}, extra={"routing": {"name": "adakv", "params": {}}})
    plain = runs[4].name
    for baseline in ("triattention", None):
        rep = report.build_report([tmp_path], baseline=baseline, boot=200)
        assert len(rep.comparisons) == 4
        assert {c["baseline_run"] for c in rep.comparisons} == {plain}


def test_paired_arms_at_different_slot_counts_are_flagged(tmp_path):
    """A record depends on the slot count it was decoded at: a report warns when paired records
    were decoded at different ones, and says nothing when they match."""
    a = make_run(tmp_path, scorer="alpha", n=8)
    b = make_run(tmp_path, scorer="triattention", n=8, seed=2)
    for d, slots in ((a, 16), (b, 16)):
        _write_records(d, [dict(r, slots=slots) for r in _records(d)])
    rep = report.build_report([tmp_path], boot=200)
    assert not [n for n in rep.notes if "slot counts" in n]
    _write_records(b, [dict(r, slots=4 if r["sample"] == 0 else 16) for r in _records(b)])
    rep = report.build_report([tmp_path], boot=200)
    warned = [n for n in rep.notes if "slot counts" in n]
    assert len(warned) == 1 and "8 paired record(s)" in warned[0] and "(16 vs 4)" in warned[0]
