"""Environments whose actions are tool calls: the protocol's `step`, written once.

A subclass lists its tools (`Tool`: a name, a description, a JSON schema of its arguments, and the Python
function that runs it) and writes `start` and `reward`; `ToolEnvironment.step` answers every model turn:

- each parsed call runs its tool and is answered, in order, with `{"role": "tool", "name": ..., "content":
  ...}`; then each call the trainer could not parse (`turn.call_errors`) is answered, without a name;
- whatever fails (a call that could not be parsed, an unknown tool, arguments that do not fit the
  schema, the tool's own error or a time limit) is answered with content that starts with "error: " and
  says what was wrong, and is counted in `EnvReply.tool_errors` (time limits in `timeouts` too); it is
  never an exception out of `step`, since one bad call must not end a whole batch of episodes;
- a finished turn with no calls at all is the final answer: the episode ends and `self.answer` keeps
  its content; a turn cut by the token limit ends the episode with no answer (`self.answer` is None).
"""

from __future__ import annotations

import abc
import decimal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from titan_tpu.protocols.environment import EnvReply, EpisodeStart, Message, ModelTurn

# JSON schema type names, with the Python types a parsed JSON value of each has. bool is an int in
# Python but not an "integer" or a "number" in JSON.
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


class ToolError(Exception):
    """Raised by a tool for its own failure; the model reads "error: " and the message."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns when a plain string (a success) does not say enough: a failed result is
    answered as an error, and a timed-out one is counted as a time-out too."""

    text: str
    failed: bool = False
    timed_out: bool = False

    def __post_init__(self) -> None:
        if self.timed_out and not self.failed:
            raise ValueError("a timed-out tool result is a failed one: pass failed=True")


@dataclass(frozen=True)
class Tool:
    """One tool. `parameters` is the JSON schema of its arguments, an object schema:
    {"type": "object", "properties": {name: {"type": ..., "description": ...}}, "required": [...]};
    `run` is called with the arguments as keyword arguments and returns the result's text (or a
    ToolResult), or raises ToolError."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    run: Callable[..., str | ToolResult]

    def __post_init__(self) -> None:
        properties = self.parameters.get("properties", {})
        unknown = [name for name in self.parameters.get("required", ()) if name not in properties]
        if self.parameters.get("type") != "object" or not isinstance(properties, Mapping) or unknown:
            raise ValueError(
                f"tool {self.name!r}: parameters must be a JSON object schema whose 'required' names are among "
                f"its 'properties' (required but not a property: {unknown})"
            )

    def schema(self) -> dict[str, Any]:
        """The tool as `apply_chat_template(..., tools=[...])` takes it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


class ToolEnvironment(abc.ABC):
    """The base of environments whose actions are tools. A subclass:

    - calls `super().__init__(tools)` with the tools of its episodes (none: every call is answered
      "error: no tools are offered in this episode");
    - writes `start(record) -> EpisodeStart`, offering `self.tool_schemas()` as its tools;
    - writes `reward() -> float`, reading `self.answer` (None when the episode ended without one).
    """

    def __init__(self, tools: Sequence[Tool] = ()) -> None:
        self.tools = {tool.name: tool for tool in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"two tools share a name: {[tool.name for tool in tools]}")
        self.answer: str | None = None
        self.done = False

    @abc.abstractmethod
    def start(self, record: Mapping[str, Any]) -> EpisodeStart: ...

    @abc.abstractmethod
    def reward(self) -> float: ...

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def step(self, turn: ModelTurn) -> EnvReply:
        if self.done:
            raise RuntimeError("step() after the episode ended: the trainer must start a new episode")
        if not turn.finished:
            self.done = True
            return EnvReply(done=True)
        if not turn.tool_calls and not turn.call_errors:
            self.done = True
            self.answer = turn.content
            return EnvReply(done=True)
        messages: list[Message] = []
        errors = timeouts = 0
        for call in turn.tool_calls:
            result = self._run(call.name, call.arguments)
            errors += result.failed
            timeouts += result.timed_out
            content = f"error: {result.text}" if result.failed else result.text
            messages.append({"role": "tool", "name": call.name, "content": content})
        for problem in turn.call_errors:
            messages.append({"role": "tool", "content": f"error: {problem}"})
        return EnvReply(messages=messages, tool_errors=errors + len(turn.call_errors), timeouts=timeouts)

    def _run(self, name: str, arguments: Any) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            if not self.tools:
                return ToolResult("no tools are offered in this episode", failed=True)
            return ToolResult(f"unknown tool {name!r}; the tools are: {', '.join(self.tools)}", failed=True)
        problems = argument_problems(tool, arguments)
        if problems:
            return ToolResult(f"{name}: {'; '.join(problems)}", failed=True)
        try:
            result = tool.run(**arguments)
        except ToolError as error:
            return ToolResult(str(error), failed=True)
        except Exception as error:  # the tool's own bug is the model's error message, not a dead batch
            return ToolResult(f"{name} failed: {type(error).__name__}: {error}", failed=True)
        return result if isinstance(result, ToolResult) else ToolResult(result)


def argument_problems(tool: Tool, arguments: Any) -> list[str]:
    """What is wrong with `arguments` for `tool`, in words (empty when they fit). Checked: an object,
    the required names present, no name the schema does not list (the function could not take it), and
    each value of the JSON type its property names (one type or a list of them). Nested schemas, enums
    and formats are the tool's to check."""
    if not isinstance(arguments, Mapping):
        return [f"the arguments must be a JSON object, not {_json_type(arguments)}"]
    properties: Mapping[str, Any] = tool.parameters.get("properties", {})
    problems = [f"missing argument {name!r}" for name in tool.parameters.get("required", ()) if name not in arguments]
    problems += [f"unexpected argument {name!r}" for name in arguments if name not in properties]
    for name, value in arguments.items():
        wanted = properties.get(name, {}).get("type")
        names = [wanted] if isinstance(wanted, str) else list(wanted or ())
        if names and not any(_is_json_type(value, type_name) for type_name in names):
            problems.append(f"argument {name!r} must be {' or '.join(names)}, not {_json_type(value)}")
    return problems


def _is_json_type(value: Any, type_name: str) -> bool:
    if isinstance(value, bool) and type_name != "boolean":
        return False
    return isinstance(value, _JSON_TYPES.get(type_name, object))


def _json_type(value: Any) -> str:
    return next((name for name in _JSON_TYPES if _is_json_type(value, name)), type(value).__name__)


def reference_match(answer: str | None, reference: str) -> float:
    """1.0 when the final answer is the reference, else 0.0 (and 0.0 without an answer). Equal means the
    same text once surrounding white space is stripped, or the same number when both are numbers:
    "56088" and "56088.0" match, compared exactly as decimals (so two long integers that differ in a
    last digit do not match through float rounding). Anything looser (a sentence around the number,
    LaTeX) is the prompt's job: ask for the bare answer."""
    if answer is None:
        return 0.0
    answer, reference = answer.strip(), reference.strip()
    if answer == reference:
        return 1.0
    try:
        return float(decimal.Decimal(answer) == decimal.Decimal(reference))
    except decimal.InvalidOperation:
        return 0.0
