"""Reference attention modules for the cache layouts of `retention.models.layouts`, in plain PyTorch.

`configs` (the architectures as data, the documented configurations and their parameter counts),
`modules` (RMSNorm, RoPE, the attention of each family, reading and writing the one retention cache,
`retention.runtime.cache.RetentionCache.for_layout`), `model` (a causal LM around them), `deepseek`
(DeepSeek-V2/V3 checkpoints on the reference MLA), `bench` (step time against context). They decode
through `retention.runtime.engine` like any model, with the scorers of `retention.scorers`.
"""
