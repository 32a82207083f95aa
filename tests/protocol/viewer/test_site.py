"""The viewer's data and folder (protocol.viewer), and `retention view` / `report --html` on hand-made runs.

The browser half (what the page draws from these data) is tests/protocol/viewer/test_browser.py."""

from __future__ import annotations

import base64
import json
import stat

import numpy as np
import pytest

from protocol.errors import ProtocolError
from protocol.io import config_hash
from protocol.runs import assign_labels, load_run
from protocol.viewer import site_data, write_site
from protocol.viewer.cachemap import cache_map, sparse, unpack_bits
from protocol.viewer.extract import common_prefix, token_lengths
from protocol.viewer.site import MARKER, STATIC, static_text
from tests.cli import invoke


def pack(positions, n: int) -> str:
    bits = np.zeros(n, dtype=bool)
    bits[list(positions)] = True
    return base64.b64encode(np.packbits(bits, bitorder="little").tobytes()).decode("ascii")


def hand_cache(n=20, P=6) -> dict:
    """Two KV heads, one group; compaction 2 drops prompt positions 2, 3 in head 1 and quantises some."""
    a = [0, 1, 2, 3, 4, 5, 9]
    b = [0, 1, 4, 5, 9, 12, 13]
    return {"version": 1, "prompt_tokens": P, "n_positions": n, "kv_heads": 2, "groups": 1, "layers": 3,
            "prefill_stored": P, "steps": 13, "kl": [0.0, 0.125], "top1": "10",
            "compactions": [{"step": 5, "before": 11, "kept": [[7, 7]], "positions": [[pack(a, n), pack(a, n)]]},
                            {"step": 9, "before": 11, "kept": [[7, 7]], "positions": [[pack(a, n), pack(b, n)]],
                             "quantised": [[pack([0, 1], n), pack([], n)]]}]}


def test_bitsets_and_sparse_counts():
    assert unpack_bits(pack([0, 7, 8, 12], 13), 13).nonzero()[0].tolist() == [0, 7, 8, 12]
    counts = np.array([2, 0, 1, 0, 0, 2])
    sp = sparse(counts, 2)
    assert sp == {"p": [0, 2, 3], "c": [2, 1, 2]}
    assert sparse(np.array([0, 2, 2]), 2) == {"p": [1, 1]}  # all held by every pair: no counts
    with pytest.raises(ProtocolError, match="not base64"):
        unpack_bits("not base64!", 8)
    with pytest.raises(ProtocolError, match="holds 8 positions"):
        unpack_bits(pack([1], 8), 9)


def test_cache_map_folds_heads_into_counts():
    m = cache_map(hand_cache())
    assert (m["P"], m["n"], m["pairs"], m["steps"], m["prefill"]) == (6, 20, 2, 13, 6)
    first, second = m["c"]
    assert first == {"s": 5, "b": 11, "k": [7, 7], "held": {"p": [0, 1, 1, 1, 1, 1, 4]}}
    pos = np.cumsum(second["held"]["p"]).tolist()
    assert dict(zip(pos, second["held"]["c"])) == {0: 2, 1: 2, 2: 1, 3: 1, 4: 2, 5: 2, 9: 2, 12: 1, 13: 1}
    assert np.cumsum(second["q"]["p"]).tolist() == [0, 1] and second["q"]["c"] == [1, 1]


@pytest.mark.parametrize("change, message", [
    (lambda c: c["compactions"][0].update(kept=[[7, 6]]), "keeps 13 tokens but its bitsets hold 14"),
    (lambda c: c["compactions"][0].update(positions=[[pack([0], 20)]]), "1 bitsets in a compaction"),
    (lambda c: c.update(version=2), "version 2 is not 1"),
    (lambda c: c.update(n_positions=-1), "'n_positions' must be a non-negative integer"),
])
def test_cache_map_refuses_a_damaged_trace(change, message):
    cache = hand_cache()
    change(cache)
    with pytest.raises(ProtocolError, match=message):
        cache_map(cache)


def test_token_lengths_and_prefixes_count_utf16_units():
    # "𝑥" is one code point, two UTF-16 units (JavaScript string indices)
    assert token_lengths(["a", "𝑥", "", "b"], "<think>\na𝑥b") == {"o": 8, "lens": [1, 2, 0, 1]}
    assert token_lengths(["a", "c"], "ab") is None  # pieces that do not spell the text: approximate
    assert common_prefix("x𝑥yz", "x𝑥yw") == 4 and common_prefix("ab", "ab") == 2 and common_prefix("", "a") == 0


# --------------------------------------------------------------------------------------------------
# hand-made run directories


def write_run(root, scorer, budget, records, *, traces=None, trace_flag=False):
    config = {"model": "tiny-random", "scorer": scorer, "scorer_params": {}, "budget": budget, "split": "dev",
              "accounting": "mean", "temperature": 0.0, "seed": 0, "max_new_tokens": 8, "dtype": "float32"}
    h = config_hash(config)  # as `run` hashes it: loading checks it
    d = root / f"run-{scorer}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"run_id": d.name, "config_hash": h, "config": config,
                                               "trace": trace_flag}))
    (d / "records.jsonl").write_text("".join(json.dumps({"config_hash": h, **r}) + "\n" for r in records))
    if traces is not None:
        (d / "trace.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    return d


def rec(pid, ids, extracted, verdict, sample=0, **extra):
    return {"problem_id": pid, "sample": sample, "seed": sample, "output_token_ids": ids, "text": "".join(chr(97 + i) for i in ids),
            "extracted": extracted, "verdict": verdict, "gold": "1", "rule": "boxed", "reason": None,
            "compactions": 1, "cache_mean_tokens": 5.0, "output_tokens": len(ids), **extra}


PIDS = ("test/algebra/1004.json", "test/algebra/1035.json")


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "full", None, [rec(PIDS[0], [1, 2, 3], "1", True), rec(PIDS[1], [4, 5], "2", False)])
    write_run(root, "streaming", 4, [rec(PIDS[0], [1, 2, 9], "7", False), rec(PIDS[1], [4, 5], "2", False)],
              traces=[{"problem_id": PIDS[0], "sample": 0, "steps": [0], "tokens": [7.0], "cache": hand_cache()},
                      {"problem_id": PIDS[1], "sample": 0, "steps": [0], "tokens": [7.0]}], trace_flag=True)
    write_run(root, "h2o", 4, [rec(PIDS[0], [1, 2, 3], "1", True), rec(PIDS[1], [6], None, None)])
    return root


def _loaded(root):
    out = [load_run(d, with_trace=True) for d in sorted(root.iterdir())]
    assign_labels(out)
    return out


def test_site_data_rows_and_payloads(runs):
    data = site_data(_loaded(runs), None)
    arms = {a["scorer"]: a for a in data.index["arms"]}
    assert arms["full"]["ref"] is None and arms["streaming"]["ref"] == arms["h2o"]["ref"] == arms["full"]["key"]
    assert arms["streaming"]["traced"] and not arms["h2o"]["traced"]
    order = [a["scorer"] for a in data.index["arms"]]
    assert order == ["h2o", "streaming", "full"]  # labels within the budget cell, the reference last
    cells = {row[1]: dict(zip(order, row[3])) for row in data.index["problems"]}
    # [verdict, answer changed vs full, first differing token (-1: identical)]
    assert cells[PIDS[0]] == {"h2o": [1, 0, -1], "streaming": [0, 1, 2], "full": [1, None, None]}
    assert cells[PIDS[1]] == {"h2o": [None, 1, 0], "streaming": [0, 0, -1], "full": [0, None, None]}
    p0 = data.payload(0)
    assert p0["pid"] == PIDS[0] and p0["statement"].startswith("If $2^8=4^x$") and p0["gold"] == "1"
    s = p0["arms"][arms["streaming"]["key"]]
    assert s["div"] == {"token": 2, "char": 2, "changed": True} and s["trace"] == "ok"
    assert s["map"]["c"][1]["k"] == [7, 7] and s["kl"] == [0.0, 0.125] and s["top1"] == "10"
    assert p0["arms"][arms["h2o"]["key"]]["trace"] == "none"  # a run without a trace.jsonl
    assert data.payload(1)["arms"][arms["streaming"]["key"]]["trace"] == "none"  # a line without `cache`
    assert "div" not in p0["arms"][arms["full"]["key"]]
    # with a tokenizer's pieces the lengths are exact
    data = site_data(_loaded(runs), None, pieces=lambda model: (lambda ids: [chr(97 + i) for i in ids]))
    assert data.payload(0)["arms"][arms["streaming"]["key"]]["tokens"] == {"o": 0, "lens": [1, 1, 1]}


def test_write_site_replaces_its_own_folder_only(runs, tmp_path):
    data = site_data(_loaded(runs), None)
    out = tmp_path / "site"
    summary = write_site(data, out)
    assert summary["index"] == out / "index.html" and summary["records"] == 2
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {"index.html", MARKER, "data/index.js", "data/r/0.js", "data/r/1.js", *STATIC}
    assert (out / "data" / "r" / "0.js").read_text().startswith("RV.record(0, {")
    assert stat.S_IMODE(out.stat().st_mode) & 0o055 == 0o055  # readable by others, not mkdtemp's 0700
    (out / "data" / "r" / "7.js").write_text("stale")
    write_site(data, out)  # an earlier site is replaced as a whole
    assert not (out / "data" / "r" / "7.js").exists() and (out / "data" / "r" / "1.js").is_file()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ProtocolError, match="not empty and holds no viewer"):
        write_site(data, other)
    assert (other / "notes.txt").read_text() == "keep me" and len(list(tmp_path.iterdir())) == 3


def test_static_files_load_nothing_from_a_network():
    for name in ("index.html", *STATIC):
        text = static_text(name)
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
    assert "default-src 'none'" in static_text("index.html")


# --------------------------------------------------------------------------------------------------
# the commands


def site_index(site) -> dict:
    text = (site / "data" / "index.js").read_text()
    assert text.startswith("RV.index(") and text.endswith(");\n")
    return json.loads(text[len("RV.index("):-3])


def test_view_cli_single_run_and_refusals(runs, tmp_path):
    res = invoke("view", runs / "run-streaming", "--out", tmp_path / "one", "--tokenizer", "none")
    assert res.exit_code == 0, res.output
    assert f"viewer: {tmp_path / 'one' / 'index.html'} (2 problem page(s)" in res.output
    index = site_index(tmp_path / "one")
    assert "no comparison: a single run" in index["notes"] and index["comparisons"] == []
    (tmp_path / "file").write_text("x")
    res = invoke("view", runs, "--out", tmp_path / "file")
    assert res.exit_code == 1 and res.output.strip().splitlines()[-1].endswith("is a file.")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    for cmd in (["view", runs], ["report", runs, "--html", "--boot", 200]):
        out = tmp_path / "mine" if cmd[0] == "view" else tmp_path / "rep"
        if cmd[0] == "report":
            (out / "viewer").mkdir(parents=True)
            (out / "viewer" / "notes.txt").write_text("keep me")
        res = invoke(*cmd, "--out", out)
        target = out if cmd[0] == "view" else out / "viewer"
        assert res.exit_code == 1 and res.output.strip().splitlines() == [
            f"Error: viewer folder {target} is not empty and holds no viewer (viewer.json); give an empty or new folder"]
        assert (target / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "rep" / "report.csv").exists()  # refused before any work


def test_view_cli_with_comparisons_and_report_html(runs, tmp_path):
    res = invoke("view", runs, "--out", tmp_path / "site", "--baseline", "h2o", "--boot", 200)
    assert res.exit_code == 0, res.output
    index = site_index(tmp_path / "site")
    (row,) = index["comparisons"]
    assert (row["treatment"], row["baseline"], row["n"]) == ("streaming", "h2o", 2)
    assert row["acc_treatment"] == 0.0 and row["acc_baseline"] == 0.5
    assert index["figures"] and all((tmp_path / "site" / "figures" / f).is_file() for f in index["figures"])
    res = invoke("report", runs, "--baseline", "h2o", "--boot", 200, "--out", tmp_path / "rep", "--html")
    assert res.exit_code == 0, res.output
    assert f"viewer: {tmp_path / 'rep' / 'viewer' / 'index.html'}" in res.output
    site = site_index(tmp_path / "rep" / "viewer")
    assert site["comparisons"] == index["comparisons"]  # one set of statistics, the report's
    assert sorted(site["figures"]) == sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
