"""Episodes that ask a record's question and score the final answer against the record's reference.

The shared part of Calculator and PythonEnv (and of any question-and-answer environment with tools):
the record's prompt becomes the first messages, its reference answer is kept, and the reward is
`reference_match` of the final answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from titan_tpu.environments.tool_env import Tool, ToolEnvironment, reference_match
from titan_tpu.protocols.environment import EpisodeStart, Message, RecordError


class QuestionEnvironment(ToolEnvironment):
    """`prompt_field` holds the question: a string (one user message) or a list of {"role", "content"}
    messages; `answer_field` the reference answer (a string or a number; required, not empty);
    `system_prompt`, when set, is the first message (a record whose messages already start with a
    system message is refused rather than one of the two being dropped)."""

    def __init__(
        self,
        tools: Sequence[Tool] = (),
        *,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        system_prompt: str = "",
    ) -> None:
        super().__init__(tools)
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.system_prompt = system_prompt
        self.reference: str | None = None

    def start(self, record: Mapping[str, Any]) -> EpisodeStart:
        messages = self._messages(record)
        self.reference = self._reference(record)
        if self.system_prompt:
            if messages[0]["role"] == "system":
                raise RecordError(
                    f"the record's {self.prompt_field!r} starts with a system message and rl.env_args.system_prompt "
                    "is set too: keep one of them"
                )
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return EpisodeStart(messages=messages, tools=self.tool_schemas())

    def reward(self) -> float:
        if self.reference is None:
            raise RuntimeError("reward() before start(): there is no reference answer yet")
        return reference_match(self.answer, self.reference)

    def _messages(self, record: Mapping[str, Any]) -> list[Message]:
        prompt = record.get(self.prompt_field)
        if isinstance(prompt, str) and prompt.strip():
            return [{"role": "user", "content": prompt}]
        if (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt
            )
        ):
            return [{"role": m["role"], "content": m["content"]} for m in prompt]
        raise RecordError(
            f"the record's {self.prompt_field!r} (the question: rl.env_args.prompt_field) must be a non-empty string "
            f"or a list of {{'role', 'content'}} messages; found {_found(record, self.prompt_field)}"
        )

    def _reference(self, record: Mapping[str, Any]) -> str:
        value = record.get(self.answer_field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and value.strip():
            return value
        raise RecordError(
            f"the record's {self.answer_field!r} (the reference answer: rl.env_args.answer_field) must be a non-empty "
            f"string or a number; found {_found(record, self.answer_field)}"
        )


def _found(record: Mapping[str, Any], field: str) -> str:
    found = f"{type(record[field]).__name__} {str(record[field])[:80]!r}" if field in record else "no such field"
    return f"{found} (the record's fields: {', '.join(map(str, record)) or 'none'})"
