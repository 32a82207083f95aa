"""Prompt formatting: the model's chat template around one math problem."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from retention.errors import RetentionError

# DeepSeek-R1's recommended directive for math problems (and no system prompt of our own).
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(tokenizer: Any, problem_text: str) -> list[int]:
    """Token ids of the model's chat template around one user turn, ending with the generation prompt.

    The user turn is the problem (stripped) followed by `BOXED_INSTRUCTION` on its own line.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RetentionError("this tokenizer has no chat template; load the model's own tokenizer files")
    messages = [{"role": "user", "content": f"{problem_text.strip()}\n{BOXED_INSTRUCTION}"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return _token_ids(encoded)


def _token_ids(encoded: Any) -> list[int]:
    """A flat list of ints from what `apply_chat_template` returns across transformers versions
    (a list, a nested one-row list, a tensor, or a BatchEncoding / dict with `input_ids`)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        if len(encoded) != 1:
            raise RetentionError(f"expected one prompt from the chat template, got {len(encoded)}")
        encoded = encoded[0]
    return [int(i) for i in encoded]
