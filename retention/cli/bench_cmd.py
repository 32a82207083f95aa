"""`retention bench`: speed, compaction cost, measured cache and agreement figures as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("bench")
@click.option("--model", default="smollm2-135m", show_default=True, help="Model alias or local folder.")
@click.option("--scorers", default="full,streaming,random", show_default=True,
              help="Comma list of scorers and reference variants (dynamic-cache: plain transformers DynamicCache; "
                   "ideal-crop: DynamicCache cut to the budget after every step, no scoring).")
@click.option("--batch-sizes", default="1", show_default=True, help="Comma list of batch sizes (sequences per step).")
@click.option("--context", "contexts", default=None,
              help="Comma list of context lengths C: decode after C tokens of real text instead of a MATH prompt.")
@click.option("--budget", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--interval", type=click.IntRange(min=1), default=None, help="Default: min(128, budget).")
@click.option("--accounting", default="mean", show_default=True, help="Comma list of accounting modes to measure.")
@click.option("--new-tokens", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--problems", type=click.IntRange(min=0), default=5, show_default=True,
              help="Dev problems for the agreement-with-full measurement (0 = skip).")
@click.option("--agreement-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens per agreement generation (default: --new-tokens).")
@click.option("--stats", "stats_path", type=click.Path(dir_okay=False), default=None, help="Calibration stats for triattention/alpha.")
@click.option("--lambda", "lam", type=float, default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the figures to this JSON file.")
def bench_command(model, scorers, batch_sizes, contexts, budget, interval, accounting, new_tokens, problems, agreement_tokens, stats_path, lam,
                  dtype, device, threads, out):
    """Measure decode tokens/s, compaction vs decode-step time, measured cache and agreement with `full`."""
    import torch

    from protocol.splits import load_split
    from retention.bench import run_bench
    from retention.models import load_model
    from retention.scorers import get_scorer_class

    from retention.bench import REFERENCE_VARIANTS
    from retention.errors import RetentionError

    names = [s.strip() for s in scorers.split(",") if s.strip()]
    for n in names:
        if n not in REFERENCE_VARIANTS:
            get_scorer_class(n)  # fail fast on an unknown name
    sizes = _int_list(batch_sizes, "--batch-sizes")
    ctxs = _int_list(contexts, "--context") if contexts else [None]
    if not names or not sizes:
        raise RetentionError("--scorers and --batch-sizes need at least one entry")
    modes = [a.strip() for a in accounting.split(",") if a.strip()]
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model, dtype=dtype, device=device)
    dev = load_split("dev")
    params = {k: v for k, v in {"stats": stats_path, "lam": lam}.items() if v is not None}
    figures = run_bench(loaded, dev, names, budget, new_tokens, modes, problems, interval=interval, params=params,
                        agreement_tokens=agreement_tokens, echo=click.echo, batch_sizes=sizes, contexts=ctxs)
    figures["threads"] = torch.get_num_threads()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(figures, indent=2) + "\n")
        click.echo(f"wrote {out}")


def _int_list(text: str, option: str) -> list[int]:
    from retention.errors import RetentionError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RetentionError(f"{option} takes a comma list of positive integers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise RetentionError(f"{option} takes a comma list of positive integers, got {text!r}")
    return vals


commands = [bench_command]
