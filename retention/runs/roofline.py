"""How close a decode step comes to the hardware: the step's arithmetic (FLOPs of a decoder-only
transformer's products at a given context) over its measured time, beside the host's measured
matrix-product peak in the compute dtype.

FLOPs count 2 per multiply-add of the products (the convention of `torch.utils.flop_counter`, which
the tests hold the formula to): per row and layer the query, key, value and output projections and
the MLP's matrices (`mlp_matrices` of `[hidden, intermediate]`: 3 for the gated MLPs here), the
attention's two products over the `context` keys the row attends to (scores and weighted values,
every query head), and the vocabulary projection of the one new token. Norms, RoPE, softmax and
sampling are left out (a few per cent of a step at these shapes): the figure is a floor on the work,
so the achieved rate is one too.
"""

from __future__ import annotations

import time

import torch


def decode_step_flops(config, rows: int, context: float, mlp_matrices: int = 3) -> float:
    """FLOPs of one decode step of `rows` rows, each attending to `context` keys (the new one included)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    Hq = c.num_attention_heads
    G = getattr(c, "num_key_value_heads", None) or Hq
    d = getattr(c, "head_dim", None) or h // Hq
    proj = h * Hq * d * 2 + h * G * d * 2  # q and o; k and v
    mlp = mlp_matrices * h * c.intermediate_size
    attention = 2 * Hq * d * context  # q.k over the context, then the weights times the values
    per_row = 2 * (L * (proj + mlp) + h * V) + 2 * L * attention
    return rows * per_row


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """The best GFLOP/s of `repeats` products of two `[n, n]` matrices in `dtype` (one warm-up first):
    what this host's matrix kernels reach at a shape that keeps them busy."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        if out.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def roofline_line(name: str, rows: int, context: float, step_ms: float, flops: float, peak: float) -> str:
    """One line: the step's achieved GFLOP/s beside the host's peak."""
    got = flops / (step_ms / 1000) / 1e9
    return (f"roofline {name} S={rows} context {context:.0f}: {flops / 1e9:.2f} GFLOP/step in {step_ms:.1f} ms = "
            f"{got:.1f} GFLOP/s, {100 * got / peak:.1f}% of the host's {peak:.0f} GFLOP/s matmul peak")
