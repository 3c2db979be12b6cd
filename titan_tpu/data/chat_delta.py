"""The text a multi-turn rollout appends to its tokens: the first prompt, then after each sampled turn.

A rollout keeps the ids the model sampled and appends only what the template writes after them, so
the tokens trained on are exactly the tokens sampled. Rendering the conversation again and
tokenizing it whole would not give them back: a sampled call `{"name":"f"}` comes back as
`{"name": "f"}` (the template writes arguments with `tojson`), bytes that are not UTF-8 come back as
U+FFFD, and a tokenizer may merge text across the boundary differently; the policy would then be
trained on tokens it never sampled, with the log-probabilities of others.

After the model's turn (`history` ends with it, parsed: `ModelTurn.message()`) the environment
answers with messages (tool results, a user reply). What follows the end-of-turn token the model
sampled is read off the template: the whole conversation rendered with the generation prompt, from
just after that turn's end of turn (`chat_masks.end_of_turn`). Where the history rendered alone,
through its last end of turn, is a prefix of the whole, the delta is the rest. Qwen 3 is the
exception to know: it writes an empty `<think></think>` into the last turn of a conversation and
leaves it out once other turns follow (so a turn sampled without thinking looks, re-rendered,
unlike what was sampled); the turn is then found as `chat_masks.assistant_spans` finds it, after
the rendering of the turns before it, which must be a prefix of the whole, or the template is
refused: nothing else says where the sampled tokens end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from titan_tpu.data.chat_masks import end_of_turn
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError, Message

Tools = Sequence[Mapping[str, Any]] | None


def first_prompt(template: ChatTemplate, messages: Sequence[Message], tools: Tools = None, **switches: Any) -> str:
    """The episode's first prompt: its messages and the tools it offers, up to the generation prompt."""
    return template.render(messages, add_generation_prompt=True, tools=tools, **switches)


def turn_delta(
    template: ChatTemplate,
    history: Sequence[Message],
    new_messages: Sequence[Message],
    tools: Tools = None,
    **switches: Any,
) -> str:
    """What follows the end-of-turn token of `history`'s last (assistant) turn once `new_messages`
    answer it, through the generation prompt of the next turn; e.g. for ChatML with a tool result,
    "\\n<|im_start|>user\\n<tool_response>\\n6\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"."""
    if not history or history[-1].get("role") != "assistant":
        raise ChatTemplateError("a turn's delta follows an assistant turn: the history must end with one")
    if len(history) < 2:
        raise ChatTemplateError("the history opens with an assistant turn; nothing prompts it")
    eot = end_of_turn(template, **switches)
    whole = template.render([*history, *new_messages], add_generation_prompt=True, tools=tools, **switches)
    alone = template.render(history, tools=tools, **switches)
    # Through the last end of turn: right even when the turn's own text holds the end-of-turn string.
    through_turn = alone[: alone.rfind(eot) + len(eot)]
    if eot in alone and whole.startswith(through_turn):
        return whole[len(through_turn) :]
    before = template.render(history[:-1], tools=tools, **switches)
    end = whole.find(eot, len(before)) if whole.startswith(before) else -1
    if end < 0:
        raise ChatTemplateError(
            f"chat template {template.origin} renders the conversation before the model's last turn differently "
            "once more turns follow; the tokens after that turn cannot be located"
        )
    return whole[end + len(eot) :]
