"""The `merge` state: evicted values merged into their nearest kept token (`retention.policy.state.base`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from retention.errors import RetentionError
from retention.policy.state.base import State, kept_flags


@dataclass
class Merge(State):
    """Evicted values merged into their nearest kept token (module docstring)."""

    name: ClassVar[str] = "merge"
    needs_kv: ClassVar[bool] = True
    threshold: float = 0.5

    def __post_init__(self):
        if not -1.0 <= self.threshold <= 1.01:
            raise RetentionError(f"merge.threshold is a cosine similarity in [-1, 1] (or 1.01: never merge), "
                                 f"got {self.threshold}")

    @classmethod
    def trivial(cls) -> dict | None:
        return {"threshold": 1.01}  # no cosine reaches it: nothing merges

    def is_trivial(self) -> bool:
        # A cosine never exceeds 1 by more than rounding: any threshold above that merges nothing.
        return self.threshold > 1.0 + 1e-3

    def before_compaction(self, cache, rows, keep, view) -> None:
        dev = keep.device
        ridx = torch.tensor(rows, device=dev)
        for i, layer in enumerate(cache.layers):
            kp = keep if keep.dim() == 3 else keep[i]  # [B, G, k]
            keys, values, valid = view.keys[i].float(), view.values[i], view.valid[i]  # [B, G, n, d], [B, G, n]
            B, G, n, _ = keys.shape
            w = 1.0 + cache.add_extra(i, "merge.count")[:, :, :n].index_select(0, ridx)  # [B, G, n]
            kept = torch.zeros(B, G, n, dtype=torch.bool, device=dev).scatter_(2, kp, True)
            unit = torch.nn.functional.normalize(keys, dim=-1)
            sim = unit @ torch.gather(unit, 2, kp[..., None].expand(-1, -1, -1, unit.shape[-1])).transpose(-1, -2)
            best, j = sim.max(-1)  # [B, G, n]: nearest kept token of each token
            merge = valid & ~kept & (best >= self.threshold)
            wm = w * merge  # [B, G, n] the mass each merged-away token brings
            k = kp.shape[-1]
            add_w = torch.zeros(B, G, k, device=dev).scatter_add_(2, j, wm)
            add_v = torch.zeros(B, G, k, values.shape[-1], device=dev).scatter_add_(
                2, j[..., None].expand(-1, -1, -1, values.shape[-1]), wm[..., None] * values.float())
            w_kept = torch.gather(w, 2, kp)
            v_kept = torch.gather(values.float(), 2, kp[..., None].expand(-1, -1, -1, values.shape[-1]))
            new_v = (w_kept[..., None] * v_kept + add_v) / (w_kept + add_w)[..., None]
            vbuf = layer.stores["v"]
            r_ix = ridx[:, None, None].expand(B, G, k)
            g_ix = torch.arange(G, device=dev)[None, :, None].expand(B, G, k)
            vbuf[r_ix, g_ix, kp] = new_v.to(vbuf.dtype)
            layer.extra["merge.count"][r_ix, g_ix, kp] = w_kept + add_w - 1.0

    def kept_state(self, cache, rows) -> dict[str, list[torch.Tensor]]:
        """`merged`: kept tokens that represent more than themselves (absorbed an evicted token now
        or at an earlier compaction)."""
        return {"merged": kept_flags(cache, rows, "merge.count")}
