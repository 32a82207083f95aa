"""The roofline's FLOP count (issue 48, item 6) against torch's own count of a decode step."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache

from retention.models import build_tiny_random
from retention.runtime.adapter import cache_kwarg
from retention.runs.roofline import decode_step_flops, matmul_peak_gflops, roofline_line


def test_decode_step_flops_equal_torch_count():
    """One decode step of 3 rows after a 20-token prefill (21 keys attended) on the tiny Qwen2 with
    eager attention (its products are plain matmuls that the counter sees): the formula's FLOPs."""
    model, _ = build_tiny_random()
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache}
    rows, ctx = 3, 20
    with torch.inference_mode():
        model(input_ids=torch.randint(0, 200, (rows, ctx)), use_cache=True, **kw)
        with FlopCounterMode(display=False) as counter:
            model(input_ids=torch.randint(0, 200, (rows, 1)), use_cache=True, **kw,
                  logits_to_keep=1)
    assert decode_step_flops(model.config, rows, ctx + 1) == counter.get_total_flops()


def test_matmul_peak_and_line():
    peak = matmul_peak_gflops(torch.float32, n=128, repeats=2)
    assert peak > 0
    line = roofline_line("full", 64, 300, 10.0, 2e9, 400.0)
    assert line == ("roofline full S=64 context 300: 2.00 GFLOP/step in 10.0 ms = 200.0 GFLOP/s, "
                    "50.0% of the host's 400 GFLOP/s matmul peak")
