"""The scoring family: `base.py` the interface (and the family's default), one module per built-in.

A plugin subclasses the interface, imported from here: `from retention.policy.scoring import Scorer`.
"""

from retention.policy.scoring.base import Scorer, WindowScorer, topk_keep

__all__ = ['Scorer', 'WindowScorer', 'topk_keep']
