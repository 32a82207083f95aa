"""Prompt formatting: the model's chat template around one math problem, in the model's prompt style.

Two styles (`PromptStyle`), chosen per model (`prompt_style`) and recorded in the run configuration
(key `prompt`, written only when it is not "chat", so that earlier configurations keep their hash):

* "chat" (instruction models: Qwen2.5-Coder, SmolLM2, tiny models): the model's own chat template,
  its default system prompt included, around one user turn: the problem, then `BOXED_INSTRUCTION`.
* "r1" (DeepSeek-R1 and its distillations): DeepSeek's usage recommendations: no system prompt, the
  directive in the user turn, and the answer forced to open with `<think>\\n` (newer R1 templates add
  it themselves; older ones do not, and the model then sometimes skips its reasoning). Because the
  prompt opened the block, the graded text is `<think>\\n` + the output (`output_text`): an answer
  whose `</think>` never came is a trace cut off before its answer, not an answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from retention.errors import RetentionError
from retention.models.aliases import ALIASES, PromptStyle

# DeepSeek-R1's recommended directive for math problems (and no system prompt of our own).
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PROMPT_STYLES: tuple[PromptStyle, ...] = ("chat", "r1")
THINK_OPEN = "<think>\n"


def prompt_style(name: str, tokenizer: Any = None) -> PromptStyle:
    """The prompt style of model `name`: its alias's (an aliased hub id counts as the alias); for
    any other model "r1" when its chat template handles `<think>` blocks (R1-style reasoning
    models strip them from past turns), else "chat"."""
    alias = ALIASES.get(name) or next((a for a in ALIASES.values() if a.kind == "hub" and a.source == name), None)
    if alias is not None:
        return alias.prompt
    template = getattr(tokenizer, "chat_template", None)
    return "r1" if isinstance(template, str) and "</think>" in template else "chat"


def format_prompt(tokenizer: Any, problem_text: str, style: PromptStyle = "chat") -> list[int]:
    """Token ids of the model's chat template around one user turn, ending with the generation prompt.

    The user turn is the problem (stripped) followed by `BOXED_INSTRUCTION` on its own line; style
    "r1" then makes sure the assistant turn opens with `<think>\\n`.
    """
    if style not in PROMPT_STYLES:
        raise RetentionError(f"unknown prompt style {style!r}: use one of {', '.join(PROMPT_STYLES)}")
    if not getattr(tokenizer, "chat_template", None):
        raise RetentionError("this tokenizer has no chat template; load the model's own tokenizer files")
    messages = [{"role": "user", "content": f"{problem_text.strip()}\n{BOXED_INSTRUCTION}"}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = _token_ids(encoded)
    if style == "r1" and not opens_think(tokenizer, ids):
        ids += tokenizer.encode(THINK_OPEN, add_special_tokens=False)
    return ids


def opens_think(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends inside an opened `<think>` block (so the output starts in it)."""
    return tokenizer.decode(prompt_ids[-8:]).rstrip().endswith("<think>")


def output_text(tokenizer: Any, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The text of one answer as graded and recorded: the decoded output, preceded by `<think>\\n`
    when the prompt opened the block (the grader then knows an unclosed trace has no answer)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return THINK_OPEN + text if opens_think(tokenizer, prompt_ids) else text


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
