"""The decoding family: `base.py` the interface (and the family's default), one module per built-in.

A plugin subclasses the interface, imported from here: `from retention.policy.decoding import Decoding`.
"""

from retention.policy.decoding.base import Decoding

__all__ = ['Decoding']
