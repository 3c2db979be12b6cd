"""Which tokens of a rendered conversation the model learns: the loss mask of supervised fine-tuning.

A conversation is rendered whole with the checkpoint's template (`chat_template.py`) and tokenized
once, so the ids are the ones `apply_chat_template` gives. The mask then covers each assistant turn
as it appears in that text: from the end of the assistant header the template writes (the
generation prompt's text) through the template's end-of-turn token, and nothing else (not the
newline a template writes after the end of turn, not the next turn's header).

Why spans in the whole text rather than rendering each turn alone: templates rewrite earlier turns
(Qwen 3 drops the reasoning of every answer before the last user message), so a turn rendered on
its own is not the text the model is trained on. What is needed is only that the conversation up to
a turn renders as a prefix of the whole (true of every published template: a prompt is rendered by
the same program that renders the rest); a template that breaks it is refused, not guessed at.

Prompt/completion records follow TRL's SFTTrainer with `completion_only_loss`: the completion's
tokens are those after the longest common prefix of the prompt's ids and the whole record's ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError, Message

TrainOn = Literal["assistant", "last_assistant", "completion", "all"]
ROLES = ("system", "user", "assistant", "tool")
_PROBE_USER, _PROBE_ANSWER = "Probe question.", "Probe answer."


class OffsetTokenizer(Protocol):
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class MaskedTokens:
    """One example: its token ids and, per token, whether the loss counts it as a target."""

    ids: list[int]
    trained: list[bool]


def check_messages(messages: Any, where: str) -> list[Message]:
    """A conversation as records hold it: a non-empty list of {role, content} with known roles."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError(
            f"{where}: an empty conversation"
            if messages == []
            else f"{where}: messages must be a list of turns, got {type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ChatTemplateError(f"{where}: turn {i} is not an object with a 'role'")
        if message["role"] not in ROLES:
            raise ChatTemplateError(
                f"{where}: turn {i} has unknown role {message['role']!r}; allowed: {', '.join(ROLES)}"
            )
    return messages


def end_of_turn(template: ChatTemplate, **switches: Any) -> str:
    """What the template writes right after an assistant's text (Qwen 3: <|im_end|>, Llama 3:
    <|eot_id|>), found by rendering a probe, whitespace trimmed."""
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ANSWER}]
    text = template.render(probe, **switches)
    after = text[text.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER) :].strip()
    if not after:
        raise ChatTemplateError(
            f"chat template {template.origin} writes nothing after an assistant turn: "
            "the model could never learn to stop"
        )
    return after


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items (characters, token ids) a and b share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def assistant_spans(
    template: ChatTemplate, messages: Sequence[Message], where: str, **switches: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The whole conversation's text and each assistant turn's [start, end) in it."""
    text = template.render(messages, **switches)
    eot = end_of_turn(template, **switches)
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if k == 0:
            raise ChatTemplateError(f"{where}: the conversation opens with an assistant turn; nothing prompts it")
        before = template.render(messages[:k], **switches)
        prompt = template.render(messages[:k], add_generation_prompt=True, **switches)
        if not text.startswith(before):
            raise ChatTemplateError(
                f"{where}: chat template {template.origin} renders turns before {k} differently within the "
                "whole conversation; the assistant tokens cannot be located"
            )
        start = len(before) + common_prefix(prompt[len(before) :], text[len(before) :])
        end = text.find(eot, start)
        if end < 0:
            raise ChatTemplateError(f"{where}: assistant turn {k} has no end-of-turn {eot!r} in the rendered text")
        spans.append((start, end + len(eot)))
    return text, spans


def _tokens_in_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token, whether it overlaps a span (a token straddling a span's edge counts)."""
    return [any(start < s_end and end > s_start for s_start, s_end in spans) for start, end in offsets]


def conversation_tokens(
    template: ChatTemplate,
    tokenizer: OffsetTokenizer,
    messages: Sequence[Message],
    train_on: TrainOn,
    where: str,
    **switches: Any,
) -> MaskedTokens:
    """A `messages` record as token ids with the mask `train_on` asks for: every assistant turn,
    the last one, or all tokens."""
    if train_on == "completion":
        raise ChatTemplateError(f"{where}: sft.train_on = 'completion' needs prompt/completion records, not messages")
    check_messages(list(messages), where)
    text, spans = assistant_spans(template, messages, where, **switches)
    ids, offsets = tokenizer.encode_with_offsets(text)
    if train_on == "all":
        return MaskedTokens(ids, [True] * len(ids))
    if not spans:
        raise ChatTemplateError(f"{where}: no assistant turn to learn from")
    chosen = spans[-1:] if train_on == "last_assistant" else spans
    return MaskedTokens(ids, _tokens_in_spans(offsets, chosen))


def completion_tokens(
    tokenizer: OffsetTokenizer, prompt: str, completion: str, eos: str, bos: str | None, train_on: TrainOn, where: str
) -> MaskedTokens:
    """A plain-text prompt/completion record, as TRL's SFTTrainer makes it: bos (when the tokenizer
    has one) + prompt + completion + eos (unless the completion already ends with it); with
    `train_on = "completion"` the targets are the tokens after the prompt's."""
    if train_on in ("assistant", "last_assistant"):
        raise ChatTemplateError(
            f"{where}: sft.train_on = {train_on!r} needs messages records; use 'completion' or 'all' "
            "for prompt/completion records"
        )
    if not completion.endswith(eos):
        completion += eos
    prefix = bos or ""
    prompt_ids = tokenizer.encode(prefix + prompt)
    ids = tokenizer.encode(prefix + prompt + completion)
    if train_on == "all":
        return MaskedTokens(ids, [True] * len(ids))
    shared = common_prefix(prompt_ids, ids)
    return MaskedTokens(ids, [False] * shared + [True] * (len(ids) - shared))


def conversational_completion_tokens(
    template: ChatTemplate,
    tokenizer: OffsetTokenizer,
    prompt: Sequence[Message],
    completion: Sequence[Message],
    train_on: TrainOn,
    where: str,
    **switches: Any,
) -> MaskedTokens:
    """A prompt/completion record whose fields are lists of turns, as TRL's SFTTrainer makes it: the
    whole conversation rendered, and with `train_on = "completion"` the targets are the tokens after
    the common prefix with the prompt rendered alone with the generation prompt. "assistant" and
    "last_assistant" treat the record as the conversation prompt + completion."""
    messages = check_messages([*prompt, *completion], where)
    if train_on in ("assistant", "last_assistant", "all"):
        return conversation_tokens(template, tokenizer, messages, train_on, where, **switches)
    prompt_ids = tokenizer.encode(template.render(prompt, add_generation_prompt=True, **switches))
    ids = tokenizer.encode(template.render(messages, **switches))
    shared = common_prefix(prompt_ids, ids)
    return MaskedTokens(ids, [False] * shared + [True] * (len(ids) - shared))
