"""Linear layers whose bfloat16 weights are reordered once, at load time, for the CPU's matrix kernel.

On CPU a bfloat16 `F.linear` runs oneDNN's matrix product, and oneDNN first reorders the weight
into its blocked layout, on every call. `PackedLinear` keeps that reordered copy
(`torch.ops.mkldnn._reorder_linear_weight`) and calls the same kernel on it
(`torch.ops.mkldnn._linear_pointwise`). The product is the same one: on an AVX512-BF16 host its
outputs were bit for bit `F.linear`'s at every row count from 1 to 64 for every shape of
qwen2.5-coder-0.5b, SmolLM2-135M and the tiny test model, with and without a bias
(`tests/retention/test_packing.py` checks the records of whole runs), and a step saved the reorder:
a 16 x 896 x 4864 product took 0.34 against 0.55 ms, a 64-row one 1.79 against 2.28 ms
(`results/packed-linears/probes/linear_speed.log`). float32 is left alone: there `F.linear` is MKL's product, not
oneDNN's, and the packed one differs from it in the last bits.

The reordered copy is extra memory (the weights of every linear layer once more, about 1 GB for
qwen2.5-coder-0.5b with its tied 151,936-token head), so `pack_linears` packs only while the copies
fit in a stated share of the memory available. `PackedLinear` is an `nn.Linear` (same parameters,
same state dict); it uses the copy only where the call is the one it was packed for (CPU, bfloat16
input, no gradient) and the weight has not been written since, and is plain `F.linear` otherwise.
A deep copy or an unpickled module packs its own weight again (the opaque copy cannot be copied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS_HINT = 64  # the row count oneDNN is told to expect; any count runs on the same copy


def packing_supported(dtype: torch.dtype, device: str | torch.device) -> bool:
    """True where `pack_linears` packs: bfloat16 on a CPU whose oneDNN has bfloat16 kernels."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu"
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of a `[out, in]` bfloat16 weight (an opaque `torch._mkldnn` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the reordered copy of `weight`: `x` `[..., in]` -> `[..., out]`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` that multiplies by a reordered copy of its bfloat16 weight (module doc)."""

    packed: torch.Tensor | None = None  # a plain attribute: kept out of the state dict and of .to()
    packed_version: int = -1            # the weight's version counter when it was packed

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> PackedLinear:
        """`linear` itself, its class switched, its parameters (tied ones too) untouched: the model,
        its hooks and whatever else holds the module keep holding the same object."""
        linear.__class__ = cls
        linear.repack()
        return linear

    def repack(self) -> None:
        """Reorder the weight as it is now (the copy is current until the weight is written)."""
        self.packed, self.packed_version = pack_weight(self.weight), self.weight._version

    @property
    def current(self) -> bool:
        """Whether the reordered copy is the weight as it is now."""
        return self.packed is not None and self.weight._version == self.packed_version

    def __getstate__(self) -> dict:
        # An opaque oneDNN tensor has no storage to copy or pickle: copies pack their own weight.
        state = dict(super().__getstate__())  # a copy: the module keeps its own
        state.pop("packed", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if packing_supported(self.weight.dtype, self.weight.device):
            self.repack()

    def uses_copy(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs on the reordered copy (else: `F.linear`)."""
        return (self.current and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and self.weight.device.type == "cpu"
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_copy(x):
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: torch.nn.Module, budget_bytes: int) -> int:
    """Make the bfloat16 CPU `nn.Linear`s of `model` `PackedLinear`s, in module order, while their
    copies' bytes stay within `budget_bytes` (a reorder costs in proportion to the weight's size, so
    any layer gains about as much per byte). Returns the bytes packed (0: none fits or is eligible)."""
    used = 0
    for m in list(model.modules()):
        if type(m) is not torch.nn.Linear or not packing_supported(m.weight.dtype, m.weight.device):
            continue
        size = m.weight.numel() * m.weight.element_size()
        if used + size <= budget_bytes:
            PackedLinear.of(m)
            used += size
    return used
