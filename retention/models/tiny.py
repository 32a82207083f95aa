"""tiny-random: a seeded random Qwen2 with a byte-level tokenizer, built in code (for tests)."""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from retention.models.aliases import TINY_RANDOM_SEED

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Large enough that attention and next-token distributions are far from uniform (at the usual
# 0.02 every head attends almost uniformly and greedy decoding hinges on float noise), small
# enough to stay numerically tame in float16/bfloat16.
TINY_INIT_RANGE = 0.2


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes, indexed by byte value.

    Printable Latin-1 bytes stand for themselves; the other bytes map, in order, to code points
    from 256 up, so every byte has a visible, whitespace-free symbol.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    kept = set(keep)
    symbols, extra = [], 0
    for byte in range(256):
        if byte in kept:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def build_tiny_tokenizer() -> Any:
    """A byte-level tokenizer needing no download: token id = byte value for ids 0..255, then
    `<|endoftext|>` 256, `<|im_start|>` 257, `<|im_end|>` 258 (eos); ChatML chat template.

    BPE over the 256 byte symbols with no merges, so any UTF-8 text round-trips exactly.
    """
    symbols = _byte_symbols()
    # ByteLevel's own alphabet must be what our table reproduces, or encoding would hit unknowns.
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def build_tiny_random(seed: int = TINY_RANDOM_SEED, *, layers: int = 4) -> tuple[Any, Any]:
    """A random Qwen2ForCausalLM (float32, CPU, eval) + its byte-level tokenizer, same weights for
    the same seed. Geometry: `layers` layers, hidden 64, 4 query / 2 KV heads (GQA group 2),
    head dim 16, vocab 259, RoPE theta 10000, 4096 positions, SDPA attention.

    The caller's global RNG state is left untouched.
    """
    # deferred: transformers' Qwen2 modeling adds ~1.5 s to CLI start-up (the CLI imports this module)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # every id the model can emit decodes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        initializer_range=TINY_INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.eval(), tokenizer
