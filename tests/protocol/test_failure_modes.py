"""Failure modes as data (`protocol.failure_modes`) on synthetic records: the compacted share and
its control warning, prompt evictions, departures from the full arm after vs before the eviction;
the report's notes and `failure_modes.csv`, and a report of runs without traces unchanged."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from protocol import report
from protocol.failure_modes import departed_after_eviction, divergence_token
from tests.protocol.test_report import _records, _write_records, edit_config, make_run

FULL_TOKENS = list(range(100, 110))


def _diverged(d: int | None) -> list[int]:
    """The full output with token `d` changed (None: identical)."""
    out = list(FULL_TOKENS)
    if d is not None:
        out[d] = 7
    return out


# (divergence token, extracted answer, prompt_evicted_step, compactions) per record of the traced arm
ALPHA = [(None, "1", None, 2),   # same path, same answer
         (5, "2", 2, 3),         # evicted at step 2 < divergence 5: departed after eviction
         (3, "2", 3, 3),         # evicted at step 3, divergence token 3: before (token 3 was sampled first)
         (4, "2", None, 1),      # never evicted: departed before
         (6, "1", 0, 2),         # text diverged, answer the same: not departed
         (None, "1", None, 0), (None, "1", None, 0), (None, "1", None, 0)]


def _set(d, rows, traced: bool):
    recs = _records(d)
    for rec, (div, extracted, evicted, compactions) in zip(recs, rows):
        rec.update(output_token_ids=_diverged(div), extracted=extracted, compactions=compactions)
        if traced:
            rec.update(prompt_evicted_step=evicted, prompt_held_final=None if not compactions else 0.5)
    _write_records(d, recs)


@pytest.fixture
def study(tmp_path):
    full = make_run(tmp_path, scorer="full", budget=1, n=4, k=2, seed=1)
    edit_config(full, budget=None)  # the full cache: no budget
    _set(full, [(None, "1", None, 0)] * 8, traced=False)
    alpha = make_run(tmp_path, scorer="alpha", budget=64, n=4, k=2, seed=2, meta_extra={"trace": True})
    _set(alpha, ALPHA, traced=True)
    tri = make_run(tmp_path, scorer="triattention", budget=64, n=4, k=2, seed=3)  # mostly never compacted
    _set(tri, [(None, "1", None, 1), (2, "3", None, 1)] + [(None, "1", None, 0)] * 6, traced=False)
    return tmp_path


def test_divergence_and_eviction_order():
    assert divergence_token([1, 2, 3], [1, 2, 3]) is None
    assert divergence_token([1, 2, 3], [1, 9, 3]) == 1
    assert divergence_token([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter length
    assert departed_after_eviction(2, 5) and not departed_after_eviction(5, 5)
    assert not departed_after_eviction(None, 5) and not departed_after_eviction(0, None)


def test_rows_notes_and_csv(study, tmp_path):
    rep = report.build_report([study], baseline="triattention", boot=200, boot_max=200)
    rows = {r["label"]: r for r in rep.failure_modes}
    a, t, f = rows["alpha"], rows["triattention"], rows["full"]
    assert (a["records"], a["compacted"], a["compacted_share"], a["traced"], a["prompt_evicted"]) == (8, 5, 5 / 8, 8, 3)
    assert (a["reference"], a["paired"], a["departed"]) == ("full", 8, 3)
    assert (a["departed_after_eviction"], a["departed_before_eviction"]) == (1, 2)
    assert (t["compacted"], t["traced"], t["prompt_evicted"], t["departed"]) == (2, 0, None, 1)
    assert t["departed_after_eviction"] is None  # no traces: no split by eviction
    assert f["reference"] is None and f["departed"] is None
    control = [n for n in rep.notes if "control, not a result" in n]
    assert len(control) == 1 and control[0].startswith("triattention (")
    assert "6 of 8 records never compacted" in control[0]
    (alpha_note,) = [n for n in rep.notes if n.startswith("alpha (") and "departed" in n]
    assert "prompt evicted in 3 of 8" in alpha_note and "3 of 8 paired" in alpha_note and "1 after" in alpha_note
    report.write_report(rep, tmp_path / "out")
    csv = pd.read_csv(tmp_path / "out" / "failure_modes.csv")
    assert csv.set_index("label").loc["alpha", "departed_after_eviction"] == 1
    assert "failure_modes" in (tmp_path / "out" / "report.json").read_text()


def test_the_full_arm_must_share_the_decoding(study):
    """A full run decoded at another temperature is no reference: its tokens took another path."""
    full = next(d for d in study.iterdir() if "-full-" in d.name)
    edit_config(full, temperature=0.6)
    rep = report.build_report([study], baseline="triattention", boot=200, boot_max=200)
    assert all(r["reference"] is None and r["departed"] is None for r in rep.failure_modes)
    assert not [n for n in rep.notes if "departed" in n]


def test_a_report_without_traces_or_compaction_counts_is_unchanged(tmp_path):
    for scorer, shift in (("alpha", 0.1), ("triattention", 0.0)):
        make_run(tmp_path, scorer=scorer, n=6, k=2, shift=shift, trace=True)
    rep = report.build_report([tmp_path], boot=200, boot_max=200)
    assert all(r["compacted"] is None and r["traced"] == 0 for r in rep.failure_modes)
    assert not [n for n in rep.notes if "compacted" in n or "departed" in n]
    written = report.write_report(rep, tmp_path / "out")
    assert "failure_modes.csv" not in {p.name for p in written}
