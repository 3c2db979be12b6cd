"""One fine-tuning record -> its token ids and loss mask, in whichever shape the record has.

Records hold either a conversation (`messages`: a list of role/content turns) or a prompt and a
completion (`prompt`/`completion`: two strings, or two lists of turns); the field names are the
run's (`sft.*_field`). Conversations and lists of turns are rendered with the checkpoint's chat
template; plain strings are tokenized as they are (bos, prompt, completion, eos), as TRL does.

A conversation may use tools, as TRL's SFT datasets do: a `tools` field (the JSON schemas offered,
rendered with the conversation as `apply_chat_template(..., tools=...)` renders them), assistant
turns with `tool_calls` and `tool` turns with their results. Only assistant turns are learned: the
tools' text, tool results and user turns are context (chat_masks.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from titan_tpu.data.chat_masks import (
    MaskedTokens,
    OffsetTokenizer,
    TrainOn,
    completion_tokens,
    conversation_tokens,
    conversational_completion_tokens,
)
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError


@dataclass(frozen=True)
class RecordFields:
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    tools: str = "tools"


def with_record_tools(
    record: Mapping[str, Any], where: str, field: str, switches: Mapping[str, Any], switches_key: str
) -> Mapping[str, Any]:
    """The template's variables with the record's tools, when it offers some (a missing field or a
    null, as a parquet column holds for records without tools, offers none). The tools may be a JSON
    string, as TRL's trainers read them: datasets store them so when the schemas of different records
    do not share one column type. `switches_key`: the setting `switches` came from, which a record's
    tools may not be set in as well."""
    tools = record.get(field)
    if tools is None:
        return switches
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ChatTemplateError(f"{where}: '{field}' is a string that is not JSON ({err.msg})") from None
    if not isinstance(tools, list):
        raise ChatTemplateError(f"{where}: '{field}' must be a list of JSON-schema objects, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"{where}: '{field}'[{i}] must be a JSON-schema object, got {type(tool).__name__}")
    if "tools" in switches:
        raise ChatTemplateError(
            f"{where}: the record offers '{field}' and {switches_key} sets tools too; keep one of them"
        )
    return {**switches, "tools": tools}


def record_tokens(
    record: Mapping[str, Any],
    where: str,
    fields: RecordFields,
    template: ChatTemplate,
    tokenizer: OffsetTokenizer,
    train_on: TrainOn,
    switches: Mapping[str, Any],
) -> MaskedTokens:
    """The record's ids and mask; a record in neither shape is one line naming the fields looked for."""
    switches = with_record_tools(record, where, fields.tools, switches, "sft.template_switches")
    if fields.messages in record:
        return conversation_tokens(template, tokenizer, record[fields.messages], train_on, where, **switches)
    if fields.prompt in record and fields.completion in record:
        prompt, completion = record[fields.prompt], record[fields.completion]
        if isinstance(prompt, str) and isinstance(completion, str):
            if record.get(fields.tools) is not None:
                raise ChatTemplateError(
                    f"{where}: tools are rendered with a conversation; '{fields.prompt}' and '{fields.completion}' "
                    "are plain strings, which are tokenized without the chat template"
                )
            eos = template.tokens.get("eos_token")
            if eos is None:
                raise ChatTemplateError(
                    f"{where}: the checkpoint's tokenizer_config.json names no eos_token to end a completion"
                )
            return completion_tokens(
                tokenizer, prompt, completion, eos, template.tokens.get("bos_token"), train_on, where
            )
        if isinstance(prompt, list) and isinstance(completion, list):
            return conversational_completion_tokens(
                template, tokenizer, prompt, completion, train_on, where, **switches
            )
        raise ChatTemplateError(
            f"{where}: '{fields.prompt}' and '{fields.completion}' must both be strings or both lists of turns, "
            f"got {type(prompt).__name__} and {type(completion).__name__}"
        )
    raise ChatTemplateError(
        f"{where}: no '{fields.messages}' field and no '{fields.prompt}'/'{fields.completion}' pair "
        f"(the record has {', '.join(sorted(map(str, record))) or 'no fields'}); set sft.messages_field "
        "or sft.prompt_field/sft.completion_field"
    )
