"""What a scorer plugin's author imports: the interface, re-exported from the mechanism wing.

The scorers themselves, and the one registry of all five families, live in `retention.policy`
(`retention.policy.scoring`, `retention.policy.registry`); this module only keeps the name plugins
import (`from retention.scorers import CacheView, Scorer`).
"""

from retention.policy.registry import READS
from retention.policy.scoring.base import Scorer, WindowScorer, topk_keep
from retention.runtime.cache import CacheView

__all__ = ["READS", "CacheView", "Scorer", "WindowScorer", "topk_keep"]
