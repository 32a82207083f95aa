"""The `shared` routing: one kept set per KV head for all layers (`retention.policy.routing.base`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from retention.policy.routing.base import Routing


@dataclass
class Shared(Routing):
    name: ClassVar[str] = "shared"
    structure: ClassVar[str | None] = "shared"
