"""The chat template and tokenizer of a run as a multi-turn rollout's codec
(titan_tpu/generation/episodes.py `TurnCodec`): an episode's first prompt, a sampled turn parsed into
content and tool calls, and the environment's messages as the tokens that follow a model turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from titan_tpu.data.chat_delta import first_prompt, turn_delta
from titan_tpu.data.chat_masks import end_of_turn
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.tokenizer import HFTokenizer
from titan_tpu.data.tool_calls import parse_model_turn
from titan_tpu.protocols.environment import EpisodeStart, Message, ModelTurn


class ChatTurnCodec:
    def __init__(self, template: ChatTemplate, tokenizer: HFTokenizer, switches: dict[str, Any]) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.switches = switches
        self.end_of_turn = end_of_turn(template, **switches)
        ids = tokenizer.encode(self.end_of_turn)
        if len(ids) != 1:
            raise ChatTemplateError(
                f"chat template {template.origin}: its end of turn {self.end_of_turn!r} is {len(ids)} tokens, not "
                "one; a multi-turn rollout stops each model turn at that token"
            )
        self.end_of_turn_id = ids[0]

    def prompt(self, start: EpisodeStart) -> list[int]:
        return self.tokenizer.encode(first_prompt(self.template, start.messages, start.tools or None, **self.switches))

    def model_turn(self, ids: Sequence[int], ended: bool) -> ModelTurn:
        return parse_model_turn(self.tokenizer.decode(ids), finished=ended)

    def delta(self, history: Sequence[Message], new: Sequence[Message], tools: Sequence[dict[str, Any]]) -> list[int]:
        text = turn_delta(self.template, list(history), list(new), list(tools) or None, **self.switches)
        return self.tokenizer.encode(text)
