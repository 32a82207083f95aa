"""The `per-layer` routing: one kept set per (layer, KV head) (`retention.policy.routing.base`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retention.policy.routing.base import Routing


@dataclass
class PerLayer(Routing):
    name: ClassVar[str] = "per-layer"
    structure: ClassVar[str | None] = "per-layer"
