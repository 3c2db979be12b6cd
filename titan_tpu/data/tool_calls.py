"""One sampled assistant turn -> its text and the tool calls it makes, as Qwen 3 and `chatml_bytes` write them.

Both templates ask for each call as a block of its own, `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`, after the turn's text (`chat_tokenizer.CHATML_TEMPLATE` keeps Qwen 3's words so
that this one parser reads both). The turn's `content` is the text outside the blocks, stripped; a
Qwen 3 reasoning block (`<think>...</think>`) is left in it, where the template finds it again when
the turn is rendered back (it splits `content` at `</think>`).

A block the model got wrong (JSON that does not parse, not an object, no name, arguments that are
not an object, a `<tool_call>` never closed) is not an exception: it becomes one line of
`call_errors`, which the environment answers as a failed call, so that the model learns the format
instead of the run stopping. A `</tool_call>` with no block open is left in the content as text.
"""

from __future__ import annotations

import json
from typing import Any

from titan_tpu.protocols.environment import ModelTurn, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL_KEYS = ("name", "arguments")


def _call(block: str) -> ToolCall | str:
    """The call a block's JSON makes, or why it makes none."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(call, dict):
        return f"expected a JSON object with 'name' and 'arguments', got {type(call).__name__}"
    extra = sorted(set(call) - set(CALL_KEYS))
    if extra:
        return f"unexpected keys {extra}; a call has only 'name' and 'arguments'"
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return "no 'name'" if name is None else f"'name' must be a non-empty string, got {json.dumps(name)}"
    if "arguments" not in call:
        return f"call to {name!r} has no 'arguments' (write {{}} for none)"
    arguments: Any = call["arguments"]
    if isinstance(arguments, str):
        # Some models write the arguments as a JSON string, the way OpenAI's API carries them.
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"call to {name!r}: 'arguments' is a string that is not JSON"
    if not isinstance(arguments, dict):
        return f"call to {name!r}: 'arguments' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name, arguments)


def parse_model_turn(text: str, finished: bool) -> ModelTurn:
    """The text of one assistant turn (decoded, without its end-of-turn token) as a ModelTurn.
    `finished` is False when the token limit cut the turn; a block left open is then reported as cut."""
    content: list[str] = []
    calls: list[ToolCall] = []
    errors: list[str] = []
    position = 0
    while (start := text.find(OPEN, position)) >= 0:
        content.append(text[position:start])
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            cut = "" if finished else " (the turn was cut by the token limit)"
            errors.append(f"call {len(calls) + len(errors) + 1}: {OPEN} is never closed by {CLOSE}{cut}")
            position = len(text)
            break
        parsed = _call(text[start + len(OPEN) : end].strip())
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(f"call {len(calls) + len(errors) + 1}: {parsed}")
        position = end + len(CLOSE)
    content.append(text[position:])
    return ModelTurn(
        text=text,
        content="".join(content).strip(),
        tool_calls=tuple(calls),
        call_errors=tuple(errors),
        finished=finished,
    )
