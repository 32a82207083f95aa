"""Figures for the cache-layout work (issue 14): measured bytes per token, KL at matched bytes, and
decode step time against context for MHA/GQA/MQA/absorbed MLA at the 124M shape.

Run: `PYTHONPATH=. .venv/bin/python scripts/layout_figures.py [--skip-timing]` (prints figures,
asserts nothing). Random weights throughout: the KL figures are a plumbing check, not a quality result.
"""

from __future__ import annotations

import argparse
import time

import torch

from retention.arch.configs import TINY, ArchConfig
from retention.arch.model import build_arch
from retention.arch.retention import decode


def measured_bytes(tokens: int = 24) -> None:
    print("layout               measured B/token  audit B/token (float32)")
    for name in TINY:
        model = build_arch(name)
        cache = model.new_cache()
        with torch.no_grad():
            model(torch.arange(tokens)[None], torch.arange(tokens)[None], cache)
        print(f"{name:<20} {cache.nbytes() / tokens:>16.1f}  {cache.layout.bytes_per_token:>12}")


def kl_at_matched_bytes(kib: float = 32.0, length: int = 128, prompt: int = 32) -> None:
    ids = [int(t) for t in torch.randint(0, 259, (length,), generator=torch.Generator().manual_seed(0))]
    print(f"\nmean KL(full || retained) over {length - prompt} decode steps at {kib:g} KiB per sequence "
          "(random weights: plumbing check)")
    print("layout               tokens  streaming      h2o")
    for name in TINY:
        model = build_arch(name)
        full = torch.stack(decode(model, ids, prompt, "full").logits)
        row = []
        for scorer in ("streaming", "h2o"):
            run = decode(model, ids, prompt, scorer, budget_bytes=int(kib * 1024), interval=8)
            p, q = torch.log_softmax(full.double(), -1), torch.log_softmax(torch.stack(run.logits).double(), -1)
            row.append(float((p.exp() * (p - q)).sum(-1)[1:].mean()))
        tokens = int(kib * 1024) // model.new_cache().layout.bytes_per_token
        print(f"{name:<20} {tokens:>6}  {row[0]:>9.4f} {row[1]:>9.4f}")


def step_time(contexts=(512, 2048, 8192), batch: int = 8, steps: int = 3) -> None:
    """One decode forward on a cache pre-filled with random stored tensors of the right shapes."""
    shape = dict(layers=12, hidden=768, q_heads=12, vocab=50_304, ffn=3072, init_range=0.02)
    configs = {
        "MHA": ArchConfig("kv", kv_heads=12, head_dim=64, **shape),
        "GQA": ArchConfig("kv", kv_heads=4, head_dim=64, **shape),
        "MQA": ArchConfig("kv", kv_heads=1, head_dim=64, **shape),
        "MLA (absorbed)": ArchConfig("mla", latent_dim=256, rope_dim=16, nope_dim=64, v_dim=64, **shape),
    }
    print(f"\ndecode step time (ms), batch {batch}, bfloat16, random weights, {torch.get_num_threads()} threads")
    print("layout          " + "".join(f"{c:>10}" for c in contexts))
    for name, cfg in configs.items():
        model = build_arch(cfg, dtype=torch.bfloat16)
        row = []
        for n in contexts:
            cache = model.new_cache()
            cache.positions = [torch.arange(n).expand(batch, cache.layout.kv_heads, -1) for _ in cache.groups]
            for s in cache.layout.stores:
                cache.tensors[s.name] = torch.randn(batch, s.heads, n, s.dim, dtype=torch.bfloat16)
            ids, pos = torch.zeros(batch, 1, dtype=torch.long), torch.full((batch, 1), n)
            times = []
            with torch.no_grad():
                for i in range(steps):
                    t = time.perf_counter()
                    model(ids, pos + i, cache, logits_to_keep=1)
                    times.append(time.perf_counter() - t)
            row.append(min(times) * 1000)
            del cache
        print(f"{name:<16}" + "".join(f"{t:>10.1f}" for t in row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    measured_bytes()
    kl_at_matched_bytes()
    if not args.skip_timing:
        step_time()
