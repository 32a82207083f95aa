"""The decoding runtime: one cache for every layout, its cadence and meter, the retention
policy, query capture, the model adapter and the one engine (transformers and reference
layout models alike)."""
