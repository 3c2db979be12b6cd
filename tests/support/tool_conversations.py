"""A tool-using conversation for the template, delta and SFT tests: two tools offered, three
assistant turns (one call with dict arguments; two calls, one with its arguments as a JSON string;
a final answer), two tool results in a row, and a user's reply after the answer."""

from __future__ import annotations

from typing import Any

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 2*3"}},
            "required": ["expression"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Today's sky in a city <as text> & nothing else.",  # <, > and & must stay unescaped
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS: list[dict[str, Any]] = [CALCULATOR, WEATHER]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
EPISODE: list[dict[str, Any]] = [
    SYSTEM,
    {"role": "user", "content": "What is two times three, and is it sunny in Paris?"},
    {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2*3"}}}],
    },
    {"role": "tool", "content": "6"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6+1"}'}},
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
        ],
    },
    {"role": "tool", "content": "7"},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "Two times three is 6, and Paris is sunny."},
    {"role": "user", "content": "Thank you!"},
]
ASSISTANT_TURNS = [i for i, message in enumerate(EPISODE) if message["role"] == "assistant"]
