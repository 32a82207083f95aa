"""`full`: no eviction, through the same cache class: the reference row of every table."""

from dataclasses import dataclass
from typing import ClassVar

from retention.policy.scoring.base import Scorer


@dataclass
class Full(Scorer):
    name: ClassVar[str] = "full"
    batch_prefill: ClassVar[bool] = True  # reads no query or attention of the forward
    evicts = False

    def score(self, view):  # never called: the policy does not compact when `evicts` is False
        raise RuntimeError("the full scorer never compacts")
