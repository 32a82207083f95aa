"""The state family: `base.py` the interface (and the family's default), one module per built-in.

A plugin subclasses the interface, imported from here: `from retention.policy.state import State`.
"""

from retention.policy.state.base import State

__all__ = ['State']
