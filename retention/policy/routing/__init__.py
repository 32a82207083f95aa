"""The routing family: `base.py` the interface (and the default), one module per built-in."""
