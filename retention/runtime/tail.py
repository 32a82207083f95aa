"""Whether the engine's tail may decode its last sequences on fewer rows without changing a record.

A decode step's row count reaches a row's arithmetic only through kernels that block their work
by it: the matrix products, which pick a tiling (and with it an order of summation) from the row
count `M`. Every other op of a transformers decode step works within a row (norms, rotary
embeddings, the attention, parallel over rows and heads). Whether a product's order changes with
`M` is a property of the host's kernels: on one AVX512-BF16 host every bfloat16 product of
qwen2.5-coder-0.5b's shapes was bit for bit the same at every `M` from 2 to 64 but its 4864 -> 896
one not at 1 row, float32 ones differed at 1-3, 5-7 and 9-11 rows, and the tiny test model's
64 -> 32 bfloat16 product at 1 and 2 rows (`results/tail-qwen0.5b/row-counts.txt`). So the
engine asks, before each narrowing.

`LinearProbe.exact(R, rows, act)`: for every distinct linear shape of the model (`nn.Linear`
modules: in and out features, dtype, bias), multiply order-revealing rows by +-1 weights at the
`R` rows of the wide step and at the narrow rows `rows` (the sequences of rows `act` moved to the
front, as the engine moves them), and compare the sequences' outputs bit for bit. A row holds
small integers beside entries of +-B, B far beyond the accumulator's precision, so a small term
survives or vanishes depending on whether it is added before or after its row's B terms cancel:
any change in the order of summation changes the sum, where ordinary data mostly round to the
same value (the 4864 -> 896 product above differs at 1 row on these rows only). Detection per
trial measured 60-70% on the tiny model's differing bfloat16 shapes (100% on float32's), so
`TRIALS` trials miss such a shape with probability below 1e-3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TRIALS = 8
DENSITY = 0.1  # share of +-B entries in a probe row (the most revealing of the densities measured)


def linear_shapes(model) -> list[tuple[int, int, torch.dtype, bool, torch.device]]:
    """The distinct `(in, out, dtype, bias, device)` of the model's `nn.Linear` modules."""
    seen = {(m.in_features, m.out_features, m.weight.dtype, m.bias is not None, m.weight.device)
            for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sorted(seen, key=str)


def order_revealing(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows of small integers (|x| < 8) with a `DENSITY` share of +-B, B = 2^5 / eps of the accumulator."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    big = 32.0 / torch.finfo(acc).eps
    x = torch.randint(-7, 8, shape, generator=g).double()
    where = torch.rand(shape, generator=g) < DENSITY
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return torch.where(where, big * sign, x).to(dtype)


class LinearProbe:
    """The model's linear shapes with +-1 weights (made once, on first use), probed at given rows."""

    def __init__(self, model, seed: int = 0):
        self.shapes = linear_shapes(model)
        self.seed = seed
        self._weights: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def _made(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        if self._weights is None:
            g = torch.Generator().manual_seed(self.seed)
            self._weights = [((torch.randint(0, 2, (n, k), generator=g, dtype=torch.int8) * 2 - 1).to(dt).to(dev),
                              torch.zeros(n, dtype=dt, device=dev) if bias else None)
                             for k, n, dt, bias, dev in self.shapes]
        return self._weights

    def exact(self, R: int, rows: list[int], act: list[int], trials: int = TRIALS) -> bool:
        """True if every linear shape gives rows `act` of an `R`-row product bit for bit what the
        same rows give at the front of a product over `rows` (`rows[:len(act)] == act`)."""
        if any(dt == torch.float16 for _, _, dt, _, _ in self.shapes):
            return False  # +-B beyond float32's precision does not fit in float16
        g = torch.Generator().manual_seed(self.seed + 1)
        same = []
        for (k, n, dt, _, dev), (w, b) in zip(self.shapes, self._made(), strict=True):
            sel, seq = torch.tensor(rows, device=dev), torch.tensor(act, device=dev)
            for _ in range(trials):
                x = order_revealing((R, 1, k), dt, g).to(dev)  # [R, 1, k]: a decode step's one token per row
                wide, narrow = F.linear(x, w, b), F.linear(x.index_select(0, sel), w, b)
                same.append((narrow[:len(act)] == wide.index_select(0, seq)).all().cpu())
        return bool(torch.stack(same).all())  # one host read


def narrow_rows(busy: list[bool]) -> list[int] | None:
    """The rows a tail of `R = len(busy)` rows decodes on next (`busy[r]`: row `r` holds a sequence):
    the busy rows in order, then padding rows up to the fewest of `R/2`, `R/4`, ... (rounded up)
    that hold them; None while more than half the rows are busy."""
    act = [r for r, b in enumerate(busy) if b]
    R, A = len(busy), len(act)
    if 2 * A > R:
        return None
    target = R
    while target > 1 and (target + 1) // 2 >= A:
        target = (target + 1) // 2
    return act + [r for r, b in enumerate(busy) if not b][:target - A]


def same_rows(forward, caches, wide, act: list[int], stats) -> tuple | None:
    """One step's forward on each narrowed cache (`caches`: retained, reference or None), compared
    bit for bit with the wide step's logits `wide` (same order) at rows `act`, which lead the narrow
    rows: the narrow logits, or None at the first difference. One host read per comparison
    (`stats.tail_syncs`)."""
    got = []
    for cache, lg in zip(caches, wide, strict=True):
        if cache is None:
            got.append(None)
            continue
        narrow = forward(cache)
        stats.tail_syncs += 1
        idx = torch.tensor(act, device=narrow.device)
        if not torch.equal(narrow[:len(act)], lg.index_select(0, idx)):
            return None
        got.append(narrow)
    return tuple(got)
