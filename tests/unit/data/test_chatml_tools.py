"""The tool template of the built-in `chatml_bytes` folder, as text (titan_tpu/data/chat_tokenizer.py).

The exact text of a short tool conversation, read by hand against Qwen 3's (tests/parity/data/
test_tool_templates.py checks transformers renders it the same); and a conversation without tools
rendered byte for byte as the template before tools rendered it, so that runs and checkpoints made
with it are unchanged. Bugs caught: the tools' system text or the call and result blocks worded
otherwise than Qwen 3's (one parser serves both), a system message not merged with the tools, a
changed rendering of plain conversations (a dropped late system turn, another header), and content
that is not text rendered as its repr.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.tool_conversations import CALCULATOR
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.chat_tokenizer import CHATML_TEMPLATE

TEMPLATE = ChatTemplate(CHATML_TEMPLATE, {}, "chatml_bytes")
SCHEMA = (
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 2*3"}}, '
    '"required": ["expression"]}}}'
)
TOOL_TEXT = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{SCHEMA}\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\n2*3?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_a_tool_conversation_renders_as_qwen3_words_it() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2*3?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "2*3"}}}]},
        {"role": "tool", "content": "6"},
        {"role": "tool", "content": "ok"},
    ]
    assert TEMPLATE.render(messages, add_generation_prompt=True, tools=[CALCULATOR]) == TOOL_TEXT
    # Without a system message the tools open the conversation alone.
    alone = TEMPLATE.render(messages[1:], add_generation_prompt=True, tools=[CALCULATOR])
    assert alone == TOOL_TEXT.replace("Be brief.\n\n", "", 1)


def test_a_conversation_without_tools_renders_as_before_tools() -> None:
    """The text the template wrote before it knew tools: every turn `<|im_start|>role\\ncontent<|im_end|>\\n`."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Spell héllo."},
        {"role": "assistant", "content": " h-é-l-l-o \n"},
        {"role": "system", "content": "Later rules."},
        {"role": "user", "content": ""},
    ]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSpell héllo.<|im_end|>\n"
        "<|im_start|>assistant\n h-é-l-l-o \n<|im_end|>\n<|im_start|>system\nLater rules.<|im_end|>\n"
        "<|im_start|>user\n<|im_end|>\n"
    )
    assert TEMPLATE.render(messages) == want
    assert TEMPLATE.render(messages, add_generation_prompt=True) == want + "<|im_start|>assistant\n"
    assert TEMPLATE.render(messages, tools=[]) == want


def test_content_that_is_not_text_is_refused() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(ChatTemplateError, match="chatml_bytes renders string content only"):
        TEMPLATE.render(parts)
