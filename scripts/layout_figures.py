"""Figures for the cache-layout work (issue 14): measured bytes per token, KL at matched bytes, and
decode step time against context for MHA/GQA/MQA/absorbed MLA at the 124M shape.

Run: `PYTHONPATH=. .venv/bin/python scripts/layout_figures.py [--skip-timing]` (prints figures,
asserts nothing). Random weights throughout: the KL figures are a plumbing check, not a quality result.
"""

from __future__ import annotations

import argparse

import torch

from retention.models.arch.bench import DEFAULT_STEPS, STUDY_BATCH, STUDY_CONTEXTS, step_times
from retention.models.arch.configs import TINY
from retention.models.arch.model import build_arch
from retention.runs.teacher_forced import decode


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


def step_time(contexts=STUDY_CONTEXTS, batch: int = STUDY_BATCH, steps: int = DEFAULT_STEPS) -> None:
    """The step-time table of `retention bench --layouts mha,gqa,mqa,mla` (`retention.models.arch.bench`)."""
    names = ["mha", "gqa", "mqa", "mla"]
    rows = step_times(names, list(contexts), [batch], steps=steps, dtype="bfloat16", echo=lambda _: None)
    print(f"\ndecode step time (ms), batch {batch}, bfloat16, random weights, {torch.get_num_threads()} threads "
          f"(median of {steps})")
    print("layout          " + "".join(f"{c:>10}" for c in contexts))
    for name in names:
        print(f"{name:<16}" + "".join(f"{r['step_ms_median']:>10.1f}" for r in rows if r["layout"] == name))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    measured_bytes()
    kl_at_matched_bytes()
    if not args.skip_timing:
        step_time()
