"""The cadence family: `base.py` the interface (and the family's default), one module per built-in.

A plugin subclasses the interface, imported from here: `from retention.policy.cadence import Cadence`.
"""

from retention.policy.cadence.base import Cadence

__all__ = ['Cadence']
