"""`retention report`: paired statistics, tables, figures and diagnostics of runs.

The work is done in `protocol.report`, imported inside the command so that `retention --help` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from retention.cli.view_cmd import echo_site, pieces_option_value, tokenizer_option


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--baseline", default=None,
              help="Baseline run (id, directory, label or scorer) [default: triattention, else the first].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("report"),
              show_default=True, help="Output directory.")
@click.option("--boot", type=click.IntRange(min=1, max=10_000_000), default=None,
              help="Cluster-bootstrap resamples [default: 100000]. A confirmed cell uses its registered "
                   "test: a differing --boot, --boot-max, --boot-seed, --alpha or --m is refused.")
@click.option("--boot-max", type=click.IntRange(min=1, max=10_000_000), default=None,
              help="Resamples used when p is within 3 MC SEs of alpha/m [default: 1000000].")
@click.option("--boot-seed", "--seed", "seed", type=click.IntRange(min=0, max=2**32 - 1), default=None,
              help="Resampling seed (--seed: old name) [default: 0].")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
              help="Family-wise significance level [default: 0.05].")
@click.option("--m", "--cells", "m", type=click.IntRange(min=1, max=1_000_000), default=None,
              help="Bonferroni family size [default: the number of comparisons that are not confirmed cells].")
@click.option("--confirm-dir", multiple=True, type=click.Path(path_type=Path),
              help="Confirm directory whose ledger and deviation log to include.")
@click.option("--html", is_flag=True, help="Also write the viewer site (`retention view`) into OUT/viewer/.")
@tokenizer_option(" of the --html viewer")
def report_cmd(run_dirs, baseline, out, boot, boot_max, seed, alpha, m, confirm_dir, html, tokenizer):
    """Paired statistics, LaTeX/CSV tables, figures and diagnostics for RUN_DIRS.

    A cell confirmed under a registered plan is reported with the plan's test (B, seed, alpha, m).
    """
    from protocol import report
    from protocol.io import check_writable_dir

    check_writable_dir(out, "--out")
    if html:
        from protocol.viewer.site import check_target

        check_target(out / "viewer")  # before any work
    rep = report.build_report(run_dirs, baseline=baseline, boot=boot, boot_max=boot_max,
                              seed=seed, alpha=alpha, m=m, confirm_dirs=confirm_dir)
    written = report.write_report(rep, out)
    click.echo(report.terminal_summary(rep))
    click.echo(f"wrote {len(written)} file(s) to {out}: {', '.join(p.name for p in written)}")
    if html:
        from protocol.viewer import view_report

        site_start = time.perf_counter()
        summary = view_report(rep, out, out / "viewer", pieces=pieces_option_value(tokenizer))
        echo_site(summary, time.perf_counter() - site_start)


commands = [report_cmd]
