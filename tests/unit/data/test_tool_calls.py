"""A sampled assistant turn parsed into its text and tool calls (titan_tpu/data/tool_calls.py).

Bugs caught: a call lost or split (two blocks read as one, a greedy match across blocks), the text
around calls dropped or the blocks left in it, arguments given as a JSON string refused, a
malformed block raising instead of becoming one `call_errors` line (or being taken as a call), an
unclosed block swallowed silently, and a parser that reads what the templates write differently
from how they write it (the round trip through Qwen 3's and chatml_bytes's rendering).
"""

from __future__ import annotations

import re

import pytest

from tests.support.chat_fixtures import published_template
from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.chat_tokenizer import CHATML_TEMPLATE
from titan_tpu.data.tool_calls import parse_model_turn
from titan_tpu.protocols.environment import ToolCall

CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_one_call_and_the_text_before_it() -> None:
    turn = parse_model_turn("Let me compute.\n" + CALC, finished=True)
    assert turn.content == "Let me compute."
    assert turn.tool_calls == (ToolCall("calculator", {"expression": "2*3"}),)
    assert turn.call_errors == () and turn.finished
    assert turn.text == "Let me compute.\n" + CALC


def test_two_calls_in_order_and_text_around_them_kept() -> None:
    turn = parse_model_turn(f"Two things.\n{CALC}\n{WEATHER}\nThen I answer.", finished=True)
    assert [call.name for call in turn.tool_calls] == ["calculator", "weather"]
    assert turn.tool_calls[1].arguments == {"city": "Paris"}
    assert turn.content == "Two things.\n\n\nThen I answer."
    assert "<tool_call>" not in turn.content and turn.call_errors == ()


def test_arguments_as_a_json_string_and_compact_json() -> None:
    text = '<tool_call>{"name":"calculator","arguments":"{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    turn = parse_model_turn(text, finished=True)
    assert turn.tool_calls == (ToolCall("calculator", {"expression": "1+1"}),)
    assert turn.content == "" and turn.call_errors == ()


def test_no_call_is_all_content_and_thinking_stays_in_it() -> None:
    turn = parse_model_turn("\n<think>\nSix.\n</think>\n\nIt is 6. \n", finished=True)
    assert turn.content == "<think>\nSix.\n</think>\n\nIt is 6."
    assert turn.tool_calls == () and turn.call_errors == ()
    assert turn.message() == {"role": "assistant", "content": turn.content}


MALFORMED = {
    "bad JSON": ('{"name": "calculator", "arguments": {', "not valid JSON"),
    "not an object": ('["calculator", {"expression": "2*3"}]', "expected a JSON object .* got list"),
    "missing name": ('{"arguments": {}}', "no 'name'"),
    "empty name": ('{"name": " ", "arguments": {}}', "'name' must be a non-empty string"),
    "name not a string": ('{"name": 7, "arguments": {}}', "'name' must be a non-empty string, got 7"),
    "missing arguments": ('{"name": "calculator"}', "no 'arguments'"),
    "arguments a list": ('{"name": "calculator", "arguments": [1]}', "'arguments' must be a JSON object, got list"),
    "arguments a non-JSON string": ('{"name": "calculator", "arguments": "2*3"}', "string that is not JSON"),
    "arguments a JSON string of a list": ('{"name": "calculator", "arguments": "[1]"}', "must be a JSON object"),
    "unexpected key": ('{"name": "calculator", "arguments": {}, "id": 1}', r"unexpected keys \['id'\]"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_each_malformed_block_is_one_error_and_the_good_call_beside_it_survives(kind: str) -> None:
    block, reason = MALFORMED[kind]
    turn = parse_model_turn(f"Trying.\n<tool_call>\n{block}\n</tool_call>\n{WEATHER}", finished=True)
    assert turn.tool_calls == (ToolCall("weather", {"city": "Paris"}),)
    assert len(turn.call_errors) == 1
    assert turn.call_errors[0].startswith("call 1: ")
    assert "\n" not in turn.call_errors[0]
    assert re.search(reason, turn.call_errors[0]), turn.call_errors[0]
    assert turn.content == "Trying."


@pytest.mark.parametrize("finished", [True, False])
def test_an_unclosed_block_is_an_error_and_not_content(finished: bool) -> None:
    turn = parse_model_turn(f'{CALC}\nAnd <tool_call>\n{{"name": "weather", "argu', finished=finished)
    assert turn.tool_calls == (ToolCall("calculator", {"expression": "2*3"}),)
    assert turn.call_errors == (
        "call 2: <tool_call> is never closed by </tool_call>"
        + ("" if finished else " (the turn was cut by the token limit)"),
    )
    assert turn.content == "And" and turn.finished is finished


def test_a_closing_tag_without_a_block_stays_text() -> None:
    turn = parse_model_turn("Done.</tool_call>", finished=True)
    assert turn.content == "Done.</tool_call>" and turn.tool_calls == () and turn.call_errors == ()


@pytest.mark.parametrize("source", ["qwen3", "chatml_bytes"])
def test_what_the_templates_write_parses_back_to_the_same_message(source: str) -> None:
    """The parser reads a turn as the template writes it: rendered, cut to the turn, parsed, the
    message is the one rendered."""
    text = published_template("qwen3") if source == "qwen3" else CHATML_TEMPLATE
    template = ChatTemplate(text, {}, source)
    message = {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}},
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
        ],
    }
    rendered = template.render([{"role": "user", "content": "Q?"}, message, {"role": "user", "content": "Ok."}])
    turn_text = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_model_turn(turn_text, finished=True).message() == message
