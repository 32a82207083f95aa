"""`retention calibrate`: pre-RoPE query statistics for `triattention` and `alpha` (per-head, or of an
MLA model's latent scores)."""

from __future__ import annotations

from pathlib import Path

import click

from retention.cli.options import splits_dir_option
from retention.errors import RetentionError


def dev_split_text(splits_dir=None) -> str:
    """The default calibration text: every dev-split problem followed by its reference solution,
    separated by blank lines. Never the confirm split (its problems are held out for confirmation)."""
    try:
        from protocol.splits import load_split
    except ImportError as exc:  # pragma: no cover - the protocol package ships with this one
        raise RetentionError(f"the dev split is not available ({exc}); pass --text FILE") from None
    problems = load_split("dev", splits_dir=splits_dir)
    return "\n\n".join(f"{p.problem.strip()}\n\n{p.solution.strip()}" for p in problems)


# Layout families without a TriAttention/alpha derivation, and why (docs/layouts.md). MLA and QK-norm
# MLA are calibrated with latent statistics (`retention.policy.scoring.calibration_latent`).
NOT_DERIVED = {
    "kv": "per-head statistics of the reference modules (interleaved RoPE pairs) are not implemented; tiny-random "
          "is the per-head model",
    "cla": "a K/V store shared by several layers has no single layer's query statistics to score it with",
    "path-concat": "a path's shared store is read by several layers with different queries",
    "path-residual": "a layer's key is rebuilt from the path's stores, no single stored key to score",
    "path-mla": "derived in docs/layouts.md, not implemented: the path's latent is read by several layers",
}

# Query statistics are per-band means over the calibration queries: one or a few tokens give the
# statistics of those tokens, not of the model. 32 is the calibration size of the golden vectors.
MIN_TOKENS = 32

@click.command("calibrate")
@click.option("--model", required=True,
              help="Model alias (r1-distill-qwen-7b, r1-distill-llama-8b, smollm2-135m, tiny-random) "
                   "or a local folder.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Statistics file to write (default: <cache>/stats/<model>.safetensors, where `retention run` "
                   "looks; cache root $RETENTION_CACHE_DIR or the user cache directory).")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="UTF-8 calibration text (default: the dev split's problems with their reference solutions; "
                   "never the confirm split).")
@click.option("--tokens", type=click.IntRange(min=MIN_TOKENS, max=1 << 24), default=8192, show_default=True,
              help=f"Calibrate on the first N tokens of the text (all of it if shorter; at least {MIN_TOKENS}).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="Model dtype while calibrating (statistics are accumulated in float64, stored float32).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N, mps.")
@splits_dir_option
def calibrate_command(model, out, text_path, tokens, dtype, device, splits_dir):
    """Compute pre-RoPE query statistics (complex mean and mean modulus per layer, query head and
    RoPE band) for the query-free scorers `triattention` and `alpha`. On an MLA model (tiny-mla,
    tiny-qk-norm-mla, a DeepSeek-V2/V3 folder): those of the rope query, and the mean content query
    and its mean modulus per dim (docs/layouts.md).

    The text is tokenised once and run in independent chunks of 2048 tokens; the file records the
    model id, head geometry, RoPE parameters, dtype, token count and the sha256 of the tokens.
    """
    from retention.policy.scoring.calibration import calibrate, default_stats_path
    from retention.policy.scoring.calibration_latent import calibrate_latent, latent_model
    from retention.models import load_model, resolve_model

    from protocol.io import check_writable, ensure_dir, read_text
    from retention.models import resolve_device

    ref = resolve_model(model)  # a bad --model or --device fails before the text is read
    if ref.kind == "arch":
        from retention.models.arch.configs import TINY

        family = TINY[ref.source].family
        if family in NOT_DERIVED:
            raise RetentionError(f"{model} is a reference layout model ({family}) on whose cache triattention and "
                                 f"alpha, the scorers these statistics serve, are not defined: {NOT_DERIVED[family]}; "
                                 "nothing to calibrate")
    resolve_device(device)
    target = Path(out) if out else default_stats_path(model)
    if text_path is not None and target.exists() and target.resolve() == Path(text_path).resolve():
        raise RetentionError(f"--out {out} is the --text input; refusing to overwrite it")
    check_writable(target, "--out")
    _refuse_overwriting_other_data(target)
    if text_path is not None:
        text = read_text(Path(text_path), "calibration text")
        source = f"file {Path(text_path).name}"
    else:
        text = dev_split_text(splits_dir)
        source = "MATH-500 dev split: problem + reference solution"
    loaded = load_model(model, dtype=dtype, device=device)
    ids = loaded.tokenizer(text)["input_ids"][:tokens]
    if len(ids) < MIN_TOKENS:
        raise RetentionError(f"the calibration text has {len(ids)} tokens; statistics need at least {MIN_TOKENS}")
    if latent_model(loaded.model) is not None:  # an MLA model: statistics of its content and rope queries
        stats, what = calibrate_latent(loaded.model, ids, model_id=loaded.model_id, text_source=source), " (MLA latent)"
    else:
        stats, what = calibrate(loaded.model, ids, model_id=loaded.model_id, text_source=source), ""
    target = target if out else default_stats_path(loaded.name)
    ensure_dir(target.parent, "statistics folder")
    path = stats.save(target)
    click.echo(f"{path}: {len(ids)} tokens, {stats.meta['geometry']['layers']} layers x "
               f"{stats.meta['geometry']['q_heads']} query heads{what}, sha256 {stats.meta['tokens_sha256'][:12]}")


def _refuse_overwriting_other_data(target: Path) -> None:
    """An existing --out is replaced only when it is a statistics file (a recalibration): anything else
    (a JSONL data file, say) would be lost to binary statistics."""
    if not target.is_file():
        return
    from retention.runs.arms import check_stats_file

    try:
        check_stats_file(target)
    except RetentionError:
        raise RetentionError(f"--out {target} exists and is not a statistics file; refusing to overwrite it "
                             "(choose another --out)") from None


commands = [calibrate_command]
