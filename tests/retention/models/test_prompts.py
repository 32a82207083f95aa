"""Prompt styles (retention.models.prompts): which model gets which prompt, the R1 `<think>`
handling, and the style recorded in the run configuration."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from protocol.grading import grade
from retention.cli import main
from retention.errors import RetentionError
from retention.models import ALIASES, BOXED_INSTRUCTION, build_tiny_random, format_prompt, output_text, prompt_style

# An R1-Distill-like template: past assistant turns lose their reasoning, the answer opens <think>.
R1_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|im_start|>' + message['content'] }}"
    "{% else %}{{ message['content'].split('</think>')[-1] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_end|>' }}{% endif %}"
)


@pytest.fixture
def tokenizer():
    return build_tiny_random()[1]


def test_each_alias_has_its_prompt_style():
    styles = {name: prompt_style(name) for name in ALIASES}
    assert styles["r1-distill-qwen-7b"] == styles["r1-distill-llama-8b"] == "r1"
    assert all(styles[n] == "chat" for n in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m", "tiny-random"))
    assert prompt_style("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B") == "r1"  # an aliased hub id


def test_other_models_are_recognised_by_their_template(tokenizer):
    assert prompt_style("/some/folder", tokenizer) == "chat"
    tokenizer.chat_template = R1_TEMPLATE
    assert prompt_style("/some/folder", tokenizer) == "r1"


def test_r1_prompt_opens_the_think_block_once(tokenizer):
    chat = format_prompt(tokenizer, "What is 1+1?")
    r1 = format_prompt(tokenizer, "What is 1+1?", "r1")
    assert tokenizer.decode(r1) == tokenizer.decode(chat) + "<think>\n"
    assert BOXED_INSTRUCTION in tokenizer.decode(r1)
    # a template that opens it itself is not given a second one
    tokenizer.chat_template = tokenizer.chat_template.replace("assistant\\n'", "assistant\\n<think>\\n'")
    opened = format_prompt(tokenizer, "What is 1+1?", "r1")
    assert tokenizer.decode(opened).endswith("assistant\n<think>\n") and opened == format_prompt(tokenizer, "What is 1+1?")
    with pytest.raises(RetentionError, match="unknown prompt style"):
        format_prompt(tokenizer, "x", "plain")


def test_an_unclosed_trace_after_an_opened_think_has_no_answer(tokenizer):
    r1 = format_prompt(tokenizer, "What is 1+1?", "r1")
    cut = tokenizer.encode("Maybe \\boxed{3}, let me check", add_special_tokens=False)
    done = tokenizer.encode("Check: 1+1=2.</think>The answer is \\boxed{2}.", add_special_tokens=False)
    assert output_text(tokenizer, r1, cut) == "<think>\nMaybe \\boxed{3}, let me check"
    assert grade(output_text(tokenizer, r1, cut), "3").verdict is not True  # tentative, cut off
    assert grade(output_text(tokenizer, r1, done), "2").verdict is True
    chat = format_prompt(tokenizer, "What is 1+1?")
    assert output_text(tokenizer, chat, cut) == "Maybe \\boxed{3}, let me check"


def test_the_prompt_style_is_recorded_and_used_in_a_run(tmp_path):
    model, tokenizer = build_tiny_random()
    tokenizer.chat_template = R1_TEMPLATE
    folder = tmp_path / "r1-like"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["run", "--model", str(folder), "--scorer", "full", "--limit", "1", "--temperature",
                                    "0", "--max-new-tokens", "3", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (run_dir,) = list(out.iterdir())
    assert json.loads((run_dir / "config.json").read_text())["config"]["prompt"] == "r1"
    record = json.loads((run_dir / "records.jsonl").read_text().splitlines()[0])
    assert record["text"].startswith("<think>\n")
