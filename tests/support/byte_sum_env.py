"""A test environment that gives a random-weight policy rewards that differ within a group: each model
turn is answered with a user message until the second, and the reward is the byte sum of what the model
said, modulo 7, over 6. It offers no tools (short prompts), and is named like a user's environment
(`rl.env = "tests.support.byte_sum_env:ByteSum"`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from titan_tpu.protocols.environment import EnvReply, EpisodeStart, ModelTurn, RecordError


class ByteSum:
    def __init__(self, turns: int = 2) -> None:
        self.turns = turns
        self.said: list[str] = []

    def start(self, record: Mapping[str, Any]) -> EpisodeStart:
        if "prompt" not in record:
            raise RecordError(f"no 'prompt' field (the record has {', '.join(sorted(record))})")
        return EpisodeStart([{"role": "user", "content": str(record["prompt"])}])

    def step(self, turn: ModelTurn) -> EnvReply:
        self.said.append(turn.text)
        done = len(self.said) == self.turns
        return EnvReply([] if done else [{"role": "user", "content": f"and then? ({len(self.said)})"}], done=done)

    def reward(self) -> float:
        return sum("".join(self.said).encode("utf-8", "replace")) % 7 / 6
