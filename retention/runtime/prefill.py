"""Batched prefill: the prompts of sequences that start together, right-padded into one forward
(chunked), then split into the single-row caches the engine compacts and loads as it does
after a prefill of one prompt alone.

Shapes: prompts `B`, longest prompt `P`, vocabulary `V`.

Why right padding needs no mask: the prefill is causal, so a real token at index `i < P_r` of row `r`
attends to keys `0..i`, all real; the padding after it is never seen by a real query. Its keys are
written into the row's buffer too, past the row's length, where every later forward masks them as
padding (`RetentionCache` module doc). Each row's first-token logits are read at its own last prompt
index (`logits_to_keep` as a tensor of those indices: the vocabulary projection of the other tokens
is not computed).

What is the same as a prefill alone: every row's stored keys and values come from the same
arithmetic on the same tokens at the same positions; the products are those of a `[B * P]`-row
matrix instead of a `[P_r]`-row one and the attention reads a wider (causally masked) block, so in
float32/bfloat16 a kernel may round a row differently (the tests bound it: the same tokens in
float32 on the tiny models). A scorer's `observe` after the prefill runs on each row's own cache,
which reads as if the row's tokens were the only ones written; a scorer that reads the forward
itself (recorded queries, attention: `Scorer.batch_prefill` False) would see the padding, so the
engine prefills those prompts one at a time.
"""

from __future__ import annotations

import torch

from retention.runtime.cache import RetentionCache

# Padded tokens (rows x longest prompt) of one batched prefill forward. Measured on SmolLM2-135M (16 dev
# prompts of 66..349 tokens, one CPU thread): 1024 prefilled them fastest in float32 and bfloat16 (4096
# was slower than 1024 by a quarter in float32; docs/speed.md); it also bounds a forward's activations.
PREFILL_CHUNK_TOKENS = 1024
PAD_TOKEN = 0  # any id: a padding token's output is never read


def chunks(lengths: list[int], budget: int = PREFILL_CHUNK_TOKENS) -> list[list[int]]:
    """Groups of indices into `lengths`, in order of length (so that a group pads its rows little),
    whose rows x longest length fits `budget` (a prompt longer than `budget` is a group of its own)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (lengths[j], j)):
        n = lengths[i]
        if groups:
            g = groups[-1]
            if (len(g) + 1) * max(n, *(lengths[j] for j in g)) <= budget:
                g.append(i)
                continue
        groups.append([i])
    return groups


def full_copy(cache: RetentionCache, capacity: int) -> RetentionCache:
    """A reference (never compacted) cache holding what single-row `cache` stores after its prefill:
    its stores and positions, not a scorer's per-token state (the fidelity proxy's full cache)."""
    ref = RetentionCache.empty_like(cache, 1, capacity)
    ref.load_row(0, cache)
    for layer in ref.layers:
        layer.extra = {}
    ref.collect_attention = False
    return ref


def prefill_alone(adapter, prompt: list[int], slot: int, reader, device) -> tuple[torch.Tensor, RetentionCache]:
    """One prompt's forward in a cache of its own (any model): its first-token logits `[1, V]` and cache
    (`reader`: what says what the run reads, `reading()`, a policy or a scorer: `ModelAdapter.new_cache`)."""
    P = len(prompt)
    cache = adapter.new_cache(P, reader)
    cache.slots, cache.prompt_lengths = [slot], [P]
    return adapter.forward(torch.tensor([prompt], device=device), torch.arange(P, device=device)[None], cache), cache


def prefill_batch(adapter, prompts: list[list[int]], reader, device) -> tuple[torch.Tensor, list[RetentionCache]]:
    """One right-padded forward of `prompts` (a transformers model): the first-token logits `[B, V]`
    (row `r` at its last prompt token) and `B` single-row caches, row `r` holding its `P_r` tokens."""
    lengths = [len(p) for p in prompts]
    B, P = len(prompts), max(lengths)
    ids = torch.full((B, P), PAD_TOKEN, dtype=torch.long, device=device)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    pos = torch.arange(P, device=device)[None].expand(B, -1)
    cache = adapter.new_cache(P, reader)
    cache.set_step_positions(pos)
    last = sorted(set(n - 1 for n in lengths))
    keep = torch.tensor(last, dtype=torch.long, device=device)
    out = adapter.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=keep,
                        **{adapter.cache_kw: cache})
    col = torch.tensor([last.index(n - 1) for n in lengths], device=device)
    logits = out.logits[torch.arange(B, device=device), col]  # [B, V]
    rows = []
    for r, n in enumerate(lengths):
        c = cache.take_rows([r])
        c.truncate(n)
        c._write_at = [0]  # what this row's forward wrote: its tokens 0..n-1 (`written_slots`, a scorer's observe)
        rows.append(c)
    return logits, rows
