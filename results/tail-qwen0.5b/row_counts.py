"""Which row counts change a linear product's rows on this host: qwen2.5-coder-0.5b's shapes and the
tiny test model's, bfloat16 and float32. For each shape, the first `m` rows of a 64-row (tiny: 4-row)
product against the same rows multiplied alone, bit for bit, on ordinary random data and on the
tail probe's order-revealing rows (`retention.runtime.tail`), 8 trials each. Then the attention:
the tail probe's attention part alone (`TailProbe` without its linear shapes) at the first `m` of
64 rows for qwen2.5-coder-0.5b (bfloat16; 191 keys, the width of its runs at budget 128) and of
16 rows for SmolLM2-135M (bfloat16 and float32; 79, 170 and 336 keys).

    python results/tail-qwen0.5b/row_counts.py > results/tail-qwen0.5b/row-counts.txt
"""

import torch
import torch.nn.functional as F

from retention.models import load_model
from retention.runtime import tail

torch.set_num_threads(2)
SHAPES = {"qwen2.5-coder-0.5b": ((896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936)),
          "tiny-random": ((64, 64), (64, 32), (64, 128), (128, 64), (64, 259))}


def differing(k, n, dt, R, revealing, trials=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randint(0, 2, (n, k), generator=g, dtype=torch.int8) * 2 - 1).to(dt)
    bad = set()
    for _ in range(trials):
        x = tail.order_revealing((R, 1, k), dt, g) if revealing else torch.randn(R, 1, k, generator=g).to(dt)
        wide = F.linear(x, w)
        bad |= {m for m in range(1, R) if not torch.equal(F.linear(x[:m], w), wide[:m])}
    return sorted(bad)


for model, shapes in SHAPES.items():
    R = 64 if model.startswith("qwen") else 4
    for dt in (torch.bfloat16, torch.float32):
        for k, n in shapes:
            print(f"{model} {str(dt)[6:]} {k}x{n} of {R} rows: differ at ordinary {differing(k, n, dt, R, False)} "
                  f"order-revealing {differing(k, n, dt, R, True)}", flush=True)

for model, dtypes, R, widths in (("qwen2.5-coder-0.5b", ("bfloat16",), 64, (191,)),
                                 ("smollm2-135m", ("bfloat16", "float32"), 16, (79, 170, 336))):
    for dt in dtypes:
        probe = tail.TailProbe(load_model(model, dtype=dt, device="cpu").model)
        probe.shapes = []  # the attention alone
        for w in widths:
            differ = [m for m in (32, 16, 8, 4, 2, 1) if m < R and not probe.exact(R, list(range(m)), list(range(m)),
                                                                                 [([w], w, False)])]
            print(f"{model} {dt} attention over {w} keys of {R} rows: differs at {differ}", flush=True)
