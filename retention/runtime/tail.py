"""Whether the engine's tail may decode its last sequences on fewer rows without changing a record.

A decode step's row count reaches a row's arithmetic through the kernels that block or split their
work by it: the matrix products, which pick a tiling (and with it an order of summation) from the
row count `M`, and the attention, which splits rows x heads x keys over threads and kernels by
shape. Norms, rotary embeddings and the other elementwise ops work within a row. What changes with
`M` is a property of the host's kernels (`results/tail-qwen0.5b/row-counts.txt`): on one
AVX512-BF16 host every bfloat16 product of qwen2.5-coder-0.5b's shapes was bit for bit the same at
every `M` from 2 to 64 but its 4864 -> 896 one not at 1 row, float32 products differed at 1-3, 5-7
and 9-11 rows, and the attention at SmolLM2's shapes (3 KV heads of 3 queries) differed at 8, 4, 2
and 1 of 16 rows over 79 and 336 keys (not over 170) in bfloat16 and float32 alike, where qwen's
(2 KV heads of 7, 191 keys) did not. So the engine asks, before each narrowing.

`TailProbe.exact(R, rows, act, widths)` runs, at the `R` rows of the wide step and at the narrow
rows `rows` (the sequences of rows `act` moved to the front, as the engine moves them), and
compares the sequences' outputs bit for bit:

* every distinct linear shape of the model (`nn.Linear`: in and out features, dtype, bias) on
  order-revealing rows with +-1 weights: small integers beside pairs of +B and -B, B far beyond
  the accumulator's precision, so a small term survives or vanishes depending on whether it is
  added before or after its row's B terms cancel (in every output whose weights give a pair
  the same sign). Any change in the order of summation changes the sum,
  where ordinary data mostly round to the same value (the 4864 -> 896 product above differs at 1
  row on these rows only);
* the model's own attention function (`retention.runtime.capture.attention_function`: whatever
  its implementation is, as transformers calls it) at every view width the run can still reach,
  with the engine's padding mask: once with zero queries (uniform weights) over order-revealing
  values, which exposes the order of the weighted sum, once with queries of ones over keys that
  are order-revealing along the head dimension, which exposes the order of the scores.

Detection per trial measured 100% on each differing product tried (the tiny model's bfloat16 ones
at 1 and 2 rows, qwen's 4864 -> 896 at 1 row, float32 at 5 of 16 rows); `TRIALS` trials guard
against shapes where it is lower. What the probe
cannot see, the engine's step check (the narrowed forward against the wide one) is there for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retention.runtime.packing import PackedLinear, pack_weight, packed_linear
from retention.runtime.capture import attention_function

TRIALS = 8
DENSITY = 0.1  # share of +-B entries in a probe row (the most revealing of the densities measured)


def linear_shapes(model) -> list[tuple[int, int, torch.dtype, bool, torch.device, bool]]:
    """The distinct `(in, out, dtype, bias, device, packed)` of the model's `nn.Linear` modules
    (`packed`: a `PackedLinear` whose copy is current, so that its product is the one to probe)."""
    seen = {(m.in_features, m.out_features, m.weight.dtype, m.bias is not None, m.weight.device,
             isinstance(m, PackedLinear) and m.current)
            for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sorted(seen, key=str)


def attention_modules(model) -> list[torch.nn.Module]:
    """One attention module of each distinct kind (class, heads, KV heads, head dim, scaling)."""
    text = model.config.get_text_config()
    kinds = {}
    for m in model.modules():
        if hasattr(m, "num_key_value_groups") and hasattr(m, "layer_idx") and hasattr(m, "head_dim"):
            key = (type(m), m.num_key_value_groups, m.head_dim, getattr(m, "scaling", None), text.num_attention_heads)
            kinds.setdefault(key, m)
    return list(kinds.values())


def order_revealing(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Rows (last axis) of small integers (|x| < 8) with `DENSITY` of their entries in pairs +B, -B
    at random places, B = 2^5 / eps of the accumulator: each row's B terms cancel exactly, and
    whether a small term is added before or after they do decides whether it survives."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    big = 32.0 / torch.finfo(acc).eps
    n = shape[-1]
    m = max(1, round(DENSITY * n / 2))
    x = torch.randint(-7, 8, shape, generator=g).double()
    places = torch.rand(shape, generator=g).argsort(-1)[..., :2 * m]  # 2m distinct entries per row
    signs = torch.cat([torch.full((m,), big), torch.full((m,), -big)]).double().expand(*shape[:-1], 2 * m)
    return x.scatter(-1, places, signs.contiguous()).to(dtype)


def _signs(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2, shape, generator=g, dtype=torch.int8) * 2 - 1).to(dtype)


class TailProbe:
    """The model's linear shapes (+-1 weights, made on first use) and attention modules, probed at
    given rows (module doc)."""

    def __init__(self, model, seed: int = 0):
        self.shapes = linear_shapes(model)
        self.attention = attention_modules(model)
        self.seed = seed
        self._weights: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None

    def _made(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per shape: the +-1 weight (reordered as the model's are where those are packed), the bias."""
        if self._weights is None:
            g = torch.Generator().manual_seed(self.seed)
            made = []
            for k, n, dt, bias, dev, packed in self.shapes:
                w = _signs((n, k), dt, g).to(dev)
                made.append((pack_weight(w) if packed else w, torch.zeros(n, dtype=dt, device=dev) if bias else None))
            self._weights = made
        return self._weights

    def exact(self, R: int, rows: list[int], act: list[int], views: list[tuple[list[int], int, bool]] = (),
              trials: int = TRIALS) -> bool:
        """True if every linear shape, and the attention over each of `views` (`(widths, capacity,
        head_mask)`: the view widths a cache can still reach, its buffers' capacity, whether its
        mask is per head: ragged rows), give rows `act` of an `R`-row call bit for bit what the
        same rows give at the front of a call over `rows` (`rows[:len(act)] == act`). One host read."""
        if any(dt == torch.float16 for _, _, dt, _, _, _ in self.shapes):
            return False  # +-B beyond float32's precision does not fit in float16
        g = torch.Generator().manual_seed(self.seed + 1)
        same = []

        def compare(wide: torch.Tensor, narrow: torch.Tensor) -> None:
            idx = torch.tensor(act, device=wide.device)
            same.append((narrow[:len(act)] == wide.index_select(0, idx)).all())

        for (k, n, dt, _, dev, packed), (w, b) in zip(self.shapes, self._made(), strict=True):
            sel = torch.tensor(rows, device=dev)
            product = packed_linear if packed else F.linear
            for _ in range(trials):
                x = order_revealing((R, 1, k), dt, g).to(dev)  # [R, 1, k]: a decode step's one token per row
                compare(product(x, w, b), product(x.index_select(0, sel), w, b))
        for module, (widths, capacity, head_mask) in ((m, v) for m in self.attention for v in views):
            for width in widths:
                for t in range(trials):
                    args = self._attention_inputs(module, R, width, max(capacity, width), head_mask, t % 2 == 0, g)
                    sel = torch.tensor(rows, device=args[0].device)
                    fn = attention_function(module)
                    wide = fn(module, *args, dropout=0.0, scaling=getattr(module, "scaling", None))[0]
                    narrow = fn(module, *(a.index_select(0, sel) for a in args), dropout=0.0,
                                scaling=getattr(module, "scaling", None))[0]
                    compare(wide, narrow)
        return bool(torch.stack(same).all()) if same else True

    @staticmethod
    def _attention_inputs(module, R: int, width: int, cap: int, head_mask: bool, uniform: bool, g):
        """query `[R, Hq, 1, d]` (a transposed projection, as the model makes it), key and value
        `[R, G, width, d]` (views of `[R, G, cap, d]` buffers, as the cache hands them over) and
        the engine's additive mask `[R, 1 or Hq, 1, width]` hiding each row's padding."""
        p = next(module.parameters())
        dt, dev, d = p.dtype, p.device, module.head_dim
        Hq = module.config.get_text_config().num_attention_heads
        G = Hq // module.num_key_value_groups
        half = max(1, width // 2)  # every row attends to at least its first `half` keys
        if uniform:  # equal weights over values whose weighted sum depends on its order
            q = torch.zeros(R, 1, Hq, d, dtype=dt)
            k = torch.randint(-3, 4, (R, G, cap, d), generator=g).to(dt)
            v = torch.zeros(R, G, cap, d, dtype=dt)  # the pairs within the keys every row attends to
            v[:, :, :half] = order_revealing((R, G, d, half), dt, g).transpose(-1, -2)
        else:  # scores whose sums over the head dimension depend on their order
            q = torch.ones(R, 1, Hq, d, dtype=dt)
            k = order_revealing((R, G, cap, d), dt, g) / 2.0 ** 5
            v = torch.randint(-7, 8, (R, G, cap, d), generator=g).to(dt)
        lengths = torch.randint(half, width + 1, (R,), generator=g)
        hidden = ~(torch.arange(width)[None] < lengths[:, None])  # [R, width]
        mask = torch.zeros(R, Hq if head_mask else 1, 1, width, dtype=dt).masked_fill_(
            hidden[:, None, None, :], torch.finfo(dt).min)
        return (q.to(dev).transpose(1, 2), k.to(dev)[:, :, :width], v.to(dev)[:, :, :width], mask.to(dev))


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
        if not bool((narrow[:len(act)] == lg.index_select(0, idx)).all()):
            return None
        got.append(narrow)
    return tuple(got)
