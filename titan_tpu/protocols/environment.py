"""What a multi-turn environment is: messages in, messages and a reward out.

An environment is a class of the user's (`rl.env = "my_envs:Calculator"`, built with `rl.env_args` as
keyword arguments), one instance per episode. The trainer owns tokens, masks, batching and parallel
ranks; the environment sees messages and dataset records only:

1. `start(record)`: the episode's first messages (a system prompt, the user's question) and the tools
   it offers, as JSON schemas the way `apply_chat_template(..., tools=...)` takes them;
2. `step(turn)`, after every model turn: the next messages (tool results, a user reply) or the end of
   the episode, with an optional per-turn reward;
3. `reward()`, once the episode has ended: the trajectory's reward, added to the per-turn ones.

A record that lacks what the environment needs is refused with `RecordError`, which the trainer reports
in one line with the record's place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, Any]


class RecordError(ValueError):
    """The record does not hold what the environment needs (say which field, and what was found)."""


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ModelTurn:
    """One model turn, as the trainer parsed it from the tokens it sampled.

    `content` is the text outside the tool calls; `call_errors` says, for each call that could not be
    parsed (bad JSON, no name), what was wrong, so that the environment can answer it as an error
    instead of the run failing; `finished` is False when the turn was cut by the token limit."""

    text: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    call_errors: tuple[str, ...] = ()
    finished: bool = True

    def message(self) -> Message:
        """The turn as an assistant message, the way chat templates take tool calls."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in self.tool_calls
            ]
        return message


@dataclass(frozen=True)
class EpisodeStart:
    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class EnvReply:
    """The environment's answer to one model turn. `tool_errors` counts the calls that failed
    (malformed, unknown tool, bad arguments, the tool's own error) and `timeouts` those stopped by a
    time limit; the trainer reports both."""

    messages: Sequence[Message] = ()
    done: bool = False
    reward: float = 0.0
    tool_errors: int = 0
    timeouts: int = 0


class Environment(Protocol):
    def start(self, record: Mapping[str, Any]) -> EpisodeStart:
        """Begin an episode from a dataset record; raise RecordError when the record cannot."""
        ...

    def step(self, turn: ModelTurn) -> EnvReply:
        """Answer the model's turn."""
        ...

    def reward(self) -> float:
        """The finished episode's reward (added to the sum of its per-turn rewards)."""
        ...
