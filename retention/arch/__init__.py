"""Reference attention modules for the cache layouts of `retention.layouts`, in plain PyTorch.

`configs` (the architectures as data, the documented configurations and their parameter counts),
`cache` (a cache that stores exactly a layout's `Store`s and evicts per sharing group), `modules`
(RMSNorm, RoPE, the attention of each family), `model` (a causal LM around them), `retention`
(scorers and compaction per sharing group on these caches), `generate` (sampled decoding under
retention, what `retention run --model tiny-<family>` runs).
"""
