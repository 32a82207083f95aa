"""`retention stats`: the paired cluster-bootstrap test (`protocol.stats`) on any paired CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import click
from click.core import ParameterSource

from protocol.errors import ProtocolError


def _read_csv_columns(path: Path, columns: list[str]) -> dict[str, list[str]]:
    import io as _io

    from protocol.io import read_text

    text = read_text(path, "CSV file")  # strict UTF-8, one clear line otherwise
    reader = csv.DictReader(_io.StringIO(text, newline=""))
    try:
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ProtocolError(f"{path}: no column(s) {missing} (has {reader.fieldnames})")
        rows = list(reader)
    except csv.Error as exc:  # e.g. a field over the csv module's 128 kB limit
        raise ProtocolError(f"{path}:{reader.line_num}: unreadable CSV ({exc})") from None
    return {c: [r[c] for r in rows] for c in columns}


def _outcomes(values: list[str], column: str) -> list:
    table = {"1": 1, "0": 0, "1.0": 1, "0.0": 0, "true": 1, "false": 0}
    out = []
    for i, v in enumerate(values):
        key = (v or "").strip().lower()
        if key not in table:
            raise ProtocolError(f"column {column}, data row {i + 1}: {v!r} is not a 0/1 outcome "
                                "(record failed generations as 0)")
        out.append(table[key])
    return out


def _fmt_p(p) -> str:
    return "--" if p is None else (f"{p:.4g}" if p >= 1e-4 else f"{p:.2e}")


def _stats_table(r: dict, title: str) -> str:
    pp = lambda x: f"{100 * x:+.2f} pp"  # noqa: E731
    ci = lambda c: f"[{100 * c[0]:+.2f}, {100 * c[1]:+.2f}] pp"  # noqa: E731
    rows = [
        ("problems n, generations k", f"{r['n']}, {r['k']}"),
        ("accuracy treatment / baseline",
         f"{100 * r['acc_treatment']:.2f}% / {100 * r['acc_baseline']:.2f}%"),
        ("mean paired difference", pp(r["estimate"])),
        ("clustered SE", f"{100 * r['se']:.2f} pp"),
        ("p cluster bootstrap (primary)",
         f"{_fmt_p(r['p_bootstrap'])} ± {r['p_bootstrap_mc_se']:.2g} MC SE "
         f"(B={r['boot']}{', escalated' if r['boot_escalated'] else ''}, seed={r['seed']})"),
        ("95% CI (percentile)", ci(r["ci95"])),
        (f"{100 * r['ci_bonferroni_level']:.4g}% CI (Bonferroni)", ci(r["ci_bonferroni"])),
        (f"p Bonferroni (m={r['m']})", _fmt_p(r["p_bonferroni"])),
        ("p Holm" + ("" if r["holm_exact"] else " (bound)"), _fmt_p(r["p_holm"])),
        ("p clustered z", f"{_fmt_p(r['p_z'])} (z = {r['z']:+.3f})"),
        (f"p sign-flip ({r['signflip_method']})", _fmt_p(r["p_signflip"])),
        ("p exact McNemar", _fmt_p(r["p_mcnemar"]) if r["k"] == 1 else "refused (k > 1)"),
        (f"MDE (alpha={r['alpha_cell']:.4g}, power {r['power']:.0%})", f"{100 * r['mde']:.2f} pp"),
        (f"verdict (p <= {r['alpha_cell']:.4g})", r["verdict"]),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join([title, *(f"  {k.ljust(width)}  {v}" for k, v in rows),
                      *(f"  note: {n}" for n in r["notes"])])


# --------------------------------------------------------------------------------------------------
# stats


@click.command("stats")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--treatment", required=True, help="Column of the treatment arm's 0/1 outcomes.")
@click.option("--baseline", required=True, help="Column of the baseline arm's 0/1 outcomes.")
@click.option("--cluster", required=True, help="Column identifying the problem (the cluster).")
@click.option("--sample", default=None, help="Column of the generation index (refuses duplicates).")
@click.option("--boot", type=click.IntRange(min=1, max=10_000_000), default=100_000, show_default=True,
              help="Cluster-bootstrap resamples.")
@click.option("--boot-max", type=click.IntRange(min=1, max=10_000_000), default=1_000_000, show_default=True,
              help="Resamples used instead when p is within 3 MC SEs of alpha/m.")
@click.option("--boot-seed", "--seed", "seed", type=click.IntRange(min=0, max=2**32 - 1), default=0,
              show_default=True, help="Resampling seed (--seed: old name).")
@click.option("--m", "--cells", "m", type=click.IntRange(min=1, max=1_000_000), default=1, show_default=True,
              help="Number m of pre-registered cells, Bonferroni over m (--cells: old name).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.05,
              show_default=True, help="Family-wise significance level.")
@click.option("--other-p", type=click.FloatRange(0, 1), multiple=True,
              help="Primary p-value of another cell (give m-1 of them for an exact Holm p).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def stats_cmd(file, treatment, baseline, cluster, sample, boot, boot_max, seed, m, alpha, other_p,
              as_json):
    """Paired test of TREATMENT vs BASELINE columns of FILE.csv, clustered by problem."""
    from protocol import stats

    if treatment == baseline:
        raise ProtocolError(f"--treatment and --baseline both name the column {treatment!r}: "
                             "a paired test needs two arms")
    given_max = click.get_current_context().get_parameter_source("boot_max") is not ParameterSource.DEFAULT
    if given_max and boot_max < boot:
        raise ProtocolError(f"--boot-max {boot_max} is below --boot {boot}: the escalated resamples "
                             "cannot be fewer than the first ones")
    cols = _read_csv_columns(file, [cluster, treatment, baseline] + ([sample] if sample else []))
    data = stats.paired_from_long(cols[cluster], _outcomes(cols[treatment], treatment),
                                  _outcomes(cols[baseline], baseline),
                                  cols[sample] if sample else None)
    result = stats.paired_test(data, alpha=alpha, m=m, boot=boot, boot_max=boot_max, seed=seed,
                               other_p=list(other_p) or None).to_dict()
    if as_json:
        from protocol.report import json_safe  # infinite z (zero SE) becomes null: strict JSON

        click.echo(json.dumps(json_safe({"file": str(file), "treatment": treatment,
                                         "baseline": baseline, "cluster": cluster, **result})))
    else:
        click.echo(_stats_table(result, f"{treatment} vs {baseline} in {file.name}, "
                                        f"clustered by {cluster}"))


commands = [stats_cmd]
