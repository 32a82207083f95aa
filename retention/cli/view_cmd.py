"""`retention view`: a static site over run directories (`protocol.viewer`; docs/viewer.md).

`report --html` (report_cmd.py) writes the same site beside its report; both take the run's
tokenizer, when it is at hand, for exact token boundaries (`tokenizer_option`, `pieces_option_value`).
"""

from __future__ import annotations

import time
from pathlib import Path

import click

def tokenizer_option(where: str = ""):
    return click.option(
        "--tokenizer", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
        help=f"Token boundaries{where} from each run's tokenizer when it loads from this machine without a "
             "download or conversion (auto), or never (none: the text is split approximately).")


def pieces_option_value(choice: str):
    """The viewer's `pieces` argument for --tokenizer: model name -> per-token decoder, or None."""
    if choice == "none":
        return None
    from retention.models.pieces import pieces_for_model

    return pieces_for_model


def echo_site(summary: dict, seconds: float) -> None:
    kib = summary["record_bytes"] / 1024
    per = kib / summary["records"] if summary["records"] else 0.0
    click.echo(f"viewer: {summary['index']} ({summary['records']} problem page(s), {kib:.0f} KiB of per-problem "
               f"data, {per:.1f} KiB each; {seconds:.1f} s)")


@click.command("view")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Site folder (new, empty, or an earlier viewer's, which is replaced); open OUT/index.html.")
@click.option("--baseline", default=None,
              help="Baseline run (id, directory, label or scorer) of the comparisons [default: as `report`].")
@click.option("--boot", type=click.IntRange(min=1, max=10_000_000), default=None,
              help="Cluster-bootstrap resamples of the comparisons [default: as `report`, 100000].")
@click.option("--boot-seed", "seed", type=click.IntRange(min=0, max=2**32 - 1), default=None,
              help="Resampling seed [default: 0].")
@click.option("--confirm-dir", multiple=True, type=click.Path(path_type=Path),
              help="Confirm directory whose ledger to include (as `report`).")
@tokenizer_option()
def view_cmd(run_dirs, out, baseline, boot, seed, confirm_dir, tokenizer):
    """A static site over RUN_DIRS, opened from file:// (no server, nothing fetched from a network).

    The index shows the report's arms and comparisons and a problem list with filters (arm, verdict,
    answer changed against the full cache) and keyboard navigation; a problem page shows, per arm, the
    text beside the full cache's with the first divergence marked, the per-step KL, the cache map
    (with --trace) and the graded answers. Per-problem data load only when opened."""
    from protocol.viewer import view_runs

    start = time.perf_counter()
    summary = view_runs(run_dirs, out, pieces=pieces_option_value(tokenizer), baseline=baseline, boot=boot,
                        seed=seed, confirm_dirs=confirm_dir)
    echo_site(summary, time.perf_counter() - start)


commands = [view_cmd]
