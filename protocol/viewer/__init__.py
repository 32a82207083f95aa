"""The run viewer: a static site over run directories (`retention view`, `retention report --html`).

`extract` turns loaded runs and their report into the site's data, `cachemap` folds a record's
cache trace into the map the page draws, `site` writes the folder; the page itself (HTML, CSS,
JavaScript) is package data under `static/`. docs/viewer.md describes what the pages show.
"""

from __future__ import annotations

from pathlib import Path

from protocol import report as reports
from protocol import report_figures
from protocol.errors import ProtocolError
from protocol.runs import assign_labels, find_run_dirs, load_run, refuse_duplicates
from protocol.viewer.extract import Pieces, SiteData, site_data
from protocol.viewer.site import check_target, write_site

__all__ = ["Pieces", "SiteData", "site_data", "view_runs", "view_report", "write_site"]


def view_runs(run_dirs, out, *, pieces=None, baseline: str | None = None, boot: int | None = None,
              seed: int | None = None, confirm_dirs=None, title: str | None = None) -> dict:
    """Load `run_dirs`, run the report's statistics when the runs form a comparison, write the site.

    A single run, or runs of which no two share a cell, are shown without comparisons (noted on the
    index). Returns `write_site`'s summary."""
    check_target(Path(out))  # before any work
    runs = [load_run(d, with_trace=True) for d in find_run_dirs(run_dirs)]
    refuse_duplicates(runs)
    assign_labels(runs)
    rep, notes = None, []
    if len(runs) >= 2 and reports.plan_comparisons(runs, baseline)[0]:
        rep = reports.report_from_runs(runs, baseline=baseline, boot=boot, seed=seed, confirm_dirs=confirm_dirs)
    else:
        notes.append("no comparison: " + ("a single run" if len(runs) < 2 else "no two runs share a cell"))
    figures = {}
    if rep is not None:
        figures, figure_notes = report_figures.render_all(rep)
        notes += [f"figure {n}" for n in figure_notes]
    data = site_data(runs, rep, pieces=pieces, title=title or _title(runs), notes=notes, figures=sorted(figures))
    return write_site(data, out, figures=figures)


def view_report(rep, report_dir, out, *, pieces=None, title: str | None = None) -> dict:
    """The site of a report already built (`retention report --html`); its figures are read from
    `report_dir`, where `write_report` put them."""
    if not rep.runs:
        raise ProtocolError("this report holds no loaded runs to view")
    figures = {p.name: p.read_bytes() for p in sorted(Path(report_dir).glob("*.png"))}
    data = site_data(rep.runs, rep, pieces=pieces, title=title or _title(rep.runs), figures=sorted(figures))
    return write_site(data, out, figures=figures)


def _title(runs) -> str:
    models = ", ".join(dict.fromkeys(r.model for r in runs))
    return f"retention viewer: {models} ({len(runs)} run{'s' if len(runs) != 1 else ''})"
