"""The routing family: `base.py` the interface (and the family's default), one module per built-in.

A plugin subclasses the interface, imported from here: `from retention.policy.routing import Routing`.
"""

from retention.policy.routing.base import Allocating, Routing

__all__ = ['Allocating', 'Routing']
