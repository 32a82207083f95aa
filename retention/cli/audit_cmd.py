"""`retention audit`: what one cached token costs under each cache layout, and the cache at a context."""

from __future__ import annotations

import json
from pathlib import Path

import click


def _layout_for(target: str, dtype: str):
    """A documented layout name, a tiny architecture name, a config.json file, or a model."""
    from retention.models.arch.configs import TINY
    from retention.errors import RetentionError
    from retention.models.layouts import DOCUMENTED, layout_from_config
    from retention.models import model_layout

    if target in DOCUMENTED:
        return DOCUMENTED[target].with_dtype(dtype)
    if target in TINY:
        return TINY[target].cache_layout().with_dtype(dtype)
    path = Path(target).expanduser()
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except ValueError as exc:
            raise RetentionError(f"{target}: not a JSON config file ({exc})") from None
        if not isinstance(config, dict):
            raise RetentionError(f"{target}: a config file holds one JSON object")
        return layout_from_config(config, dtype)
    return model_layout(target, dtype)


def audit_record(layout, context: int, batch: int) -> dict:
    """The audit of one layout: its summary, the documented parameter count where there is one,
    and the cache at `context` tokens x `batch` sequences."""
    from retention.models.arch.model import documented_parameters

    record = layout.as_dict()
    record.update(documented_parameters(layout.name))
    record.update(context=context, batch=batch, cache_bytes=layout.cache_bytes(context, batch),
                  cache_gb=layout.cache_bytes(context, batch) / 1e9)
    return record


@click.command("audit")
@click.argument("targets", nargs=-1)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True,
              help="Element type of the cache.")
@click.option("--context", type=click.IntRange(min=1, max=1 << 40), default=131_072, show_default=True, help="Cached tokens per sequence.")
@click.option("--batch", type=click.IntRange(min=1, max=1 << 30), default=8, show_default=True, help="Sequences.")
@click.option("--per-layer", is_flag=True, help="Also print the elements each layer writes and the sharing groups.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list of records instead of a table.")
def audit_command(targets, dtype, context, batch, per_layer, as_json):
    """Elements and bytes per token, per layer and for the model, and the cache at CONTEXT x BATCH.

    TARGETS are documented layout names (default: all of them), tiny architecture names
    (tiny-mla, ...), config.json files or models. Sizes count the compressed representation (what
    must be kept per token), not allocated buffers.
    """
    from retention.models.layouts import DOCUMENTED

    layouts = [_layout_for(t, dtype) for t in (targets or DOCUMENTED)]
    records = [audit_record(layout, context, batch) for layout in layouts]
    if as_json:
        click.echo(json.dumps(records, indent=2))
        return
    header = (f"{'layout':<20} {'stored per token':<28} {'elements':>9} {'bytes':>9} "
              f"{f'GB at {context:,}x{batch}':>18} {'parameters':>12}")
    click.echo(f"{dtype} cache, {layouts[0].as_dict()['counts']}")
    click.echo(header)
    for r in records:
        params = f"{r['parameters']:,}" if "parameters" in r else "-"
        click.echo(f"{r['name']:<20} {r['formula']:<28} {r['elements_per_token']:>9,} {r['bytes_per_token']:>9,} "
                   f"{r['cache_gb']:>18.2f} {params:>12}")
        if "parameters_note" in r:
            click.echo(f"{'':<20}   documented {r['parameters_documented']:,} parameters; {r['parameters_note']}")
        if per_layer:
            click.echo(f"{'':<20}   per layer: {r['layer_elements']}; sharing groups: {r['sharing_groups']}")


commands = [audit_command]
