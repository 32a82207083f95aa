"""`full`: no eviction, through the same cache class: the reference row of every table."""

from dataclasses import dataclass

from retention.scorers import register
from retention.scorers.base import Scorer


@register("full")
@dataclass
class Full(Scorer):
    evicts = False

    def score(self, view):  # never called: the policy does not compact when `evicts` is False
        raise RuntimeError("the full scorer never compacts")
