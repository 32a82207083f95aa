"""Decode step time against context for the layouts of the MHA/MQA/GQA/MLA study (issue 14).

`STUDY_124M` holds the study's 124M configurations as data (12 layers, hidden 768, 12 query heads,
vocabulary 50,304, tied embeddings, a SwiGLU of width 2048, which has the parameters of GPT-2's
GELU MLP of width 3072: the MHA row counts 123.6M parameters, GPT-2 small's 124.4M less its
learned position embeddings, which RoPE replaces); `step_times` times one decode forward of an `ArchLM` per
(layout, context) for a batch; `run_layout_bench` is what `retention bench --layouts` prints.

Shapes: batch `B`, context `n` (tokens already stored), a store's heads `h` and width `d`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from retention.dtypes import resolve_dtype
from retention.errors import RetentionError
from retention.models.arch.configs import ArchConfig
from retention.models.arch.model import ArchLM, build_arch, count_parameters
from retention.versions import library_versions

# The figure's grid (issue 14): contexts 512, 2k, 8k at batch 8, the median of 3 timed steps.
STUDY_CONTEXTS = (512, 2048, 8192)
STUDY_BATCH = 8
DEFAULT_STEPS = 3

_SHAPE_124M = dict(layers=12, hidden=768, q_heads=12, vocab=50_304, ffn=2048, tie_embeddings=True, init_range=0.02)

STUDY_124M: dict[str, ArchConfig] = {
    "mha": ArchConfig("kv", kv_heads=12, head_dim=64, **_SHAPE_124M),
    "gqa": ArchConfig("kv", kv_heads=4, head_dim=64, **_SHAPE_124M),
    "mqa": ArchConfig("kv", kv_heads=1, head_dim=64, **_SHAPE_124M),
    "mla": ArchConfig("mla", latent_dim=256, rope_dim=16, nope_dim=64, v_dim=64, **_SHAPE_124M),
}


@dataclass(frozen=True)
class Variant:
    """A timed model: a configuration and, for MLA, whether decode absorbs the up-projections."""

    config: ArchConfig
    absorb: bool = True


# `mla` is the absorbed decode the study's claim is about; `mla-materialised` is the same weights
# decoding through per-head keys/values, to show what absorption buys.
VARIANTS: dict[str, Variant] = {
    **{name: Variant(cfg) for name, cfg in STUDY_124M.items()},
    "mla-materialised": Variant(STUDY_124M["mla"], absorb=False),
}


def parse_layouts(text: str, valid: dict[str, Variant] = VARIANTS) -> list[str]:
    """A comma list of variant names, validated (one `RetentionError` line naming the valid ones)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in valid] or ([] if names else ["(none)"])
    if bad:
        raise RetentionError(f"--layouts: {', '.join(bad)} is not a layout; use a comma list of {', '.join(valid)}")
    return names


def prefilled_cache(model: ArchLM, context: int, batch: int, device):
    """A layout cache holding `context` tokens per sequence of random stored tensors `[B, h, n, d]`
    of the layout's exact stores, positions `0..n-1` per sharing group `[B, G, n]`.

    The weights are random, so prefilling real tokens would produce equally meaningless stored
    values and only cost a prefill forward (minutes at 8k on a CPU): what a decode step costs
    depends on the shapes it reads, not on the values."""
    cache = model.new_cache(capacity=context + 1)  # room for the decode step's token: written in place
    dtype = model.dtype
    cache.begin_step(torch.arange(context, device=device).expand(batch, -1))
    for s in cache.layout.stores:
        cache.append(s.name, torch.randn(batch, s.heads, context, s.dim, device=device, dtype=dtype))
    return cache


def decode_step(model: ArchLM, cache, batch: int) -> torch.Tensor:
    """One decode forward of token 0 at position `n` for every sequence -> logits `[B, 1, V]`."""
    n = max(cache.lengths)
    device = model.device
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    pos = torch.full((batch, 1), n, dtype=torch.long, device=device)
    with torch.no_grad():
        return model(ids, pos, cache, logits_to_keep=1).logits


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels are asynchronous: time them, not their launch
        torch.cuda.synchronize(device)


def time_point(model: ArchLM, context: int, batch: int, steps: int, warmup: int = 1) -> dict:
    """Median of `steps` timed decode steps at `context` after `warmup` untimed ones.

    Every step starts from the same pre-filled context (its append would otherwise grow it by one
    per step): `RetentionCache.truncate` rewinds the step's token, which the next step overwrites in
    the preallocated buffers. Bytes are measured from the pre-filled tensors (`nbytes`)."""
    device = model.device
    cache = prefilled_cache(model, context, batch, device)
    stored = cache.nbytes()
    times = []
    for i in range(warmup + steps):
        cache.truncate(context)
        _sync(device)
        t0 = time.perf_counter()
        decode_step(model, cache, batch)
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    layout = cache.layout
    return {"context": context, "batch": batch, "step_ms_median": statistics.median(times), "step_ms": times,
            "stored_bytes_per_sequence": stored // batch, "audit_bytes_per_sequence": layout.bytes_per_token * context,
            "bytes_per_token": layout.bytes_per_token}


def step_times(names: list[str], contexts: list[int], batch_sizes: list[int], *, steps: int = 3,
               dtype: str = "bfloat16", device: str = "cpu", variants: dict[str, Variant] = VARIANTS,
               echo: Callable[[str], None] = print) -> list[dict]:
    """One row per (variant, batch, context): random weights (seed 0), `dtype`, on `device`."""
    rows = []
    for name in names:
        v = variants[name]
        model = build_arch(v.config, dtype=resolve_dtype(dtype)).to(device)
        model.set_absorb(v.absorb)
        for batch in batch_sizes:
            for n in contexts:
                row = {"layout": name, "family": v.config.family, "absorb": v.absorb,
                       **time_point(model, n, batch, steps)}
                echo(f"{name:>16} B={batch:<3} ctx={n:<6}: step {row['step_ms_median']:8.1f} ms, "
                     f"stored {row['stored_bytes_per_sequence'] / 2**20:.1f} MiB/seq "
                     f"(audit {row['audit_bytes_per_sequence'] / 2**20:.1f})")
                rows.append(row)
            # The study's comparison: how much a step grows with the context (1.0 = flat).
            first = rows[-len(contexts)]["step_ms_median"]
            for row in rows[-len(contexts):]:
                row["step_vs_shortest_context"] = row["step_ms_median"] / first
        del model
    return rows


def describe(config: ArchConfig) -> dict:
    """The fields of `config` that differ from `ArchConfig`'s defaults, and its family: a field a
    family does not read (an MLA's `head_dim`) keeps its default, so listing it would mislead."""
    default = asdict(ArchConfig(config.family))
    return {k: v for k, v in asdict(config).items() if k == "family" or v != default[k]}


def run_layout_bench(names: list[str], contexts: list[int], batch_sizes: list[int], *, steps: int, dtype: str,
                     device: str, echo: Callable[[str], None] = print) -> dict:
    """The JSON figures of `retention bench --layouts`: the configurations, then the rows."""
    configs = {n: {**describe(VARIANTS[n].config), "absorb": VARIANTS[n].absorb,
                   "parameters": count_parameters(VARIANTS[n].config),
                   "bytes_per_token": VARIANTS[n].config.cache_layout().with_dtype(dtype).bytes_per_token}
               for n in names}
    rows = step_times(names, contexts, batch_sizes, steps=steps, dtype=dtype, device=device, echo=echo)
    return {"benchmark": "layout-decode-step", "weights": "random (seed 0)", "dtype": dtype, "device": device,
            "contexts": contexts, "batch_sizes": batch_sizes, "steps": steps, "warmup_steps": 1,
            "threads": torch.get_num_threads(), "configs": configs, "versions": library_versions(), "rows": rows}
