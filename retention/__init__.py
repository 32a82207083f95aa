"""retention: KV-cache retention during decode, evaluated under a strict protocol.

The runtime half (this package) evicts tokens from the KV cache while a model decodes; the
protocol half (`protocol`) grades, tests and reports the results.
"""

__version__ = "0.1.0"
