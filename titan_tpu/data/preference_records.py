"""One preference record -> the token ids of its prompt and of its two completions, as TRL's DPOTrainer
tokenizes them.

A record holds a prompt, a chosen completion and a rejected one (field names are the run's,
`dpo.prompt_field` / `chosen_field` / `rejected_field`), in one of TRL's two shapes:

- plain text: three strings. The end-of-sequence token is appended to each completion that does not
  already end with it; the prompt and each prompt + completion are tokenized as they are, after the
  checkpoint's bos token when it has one (as SFT's plain prompt/completion records are).
- conversational: three lists of turns, the prompt's ending where the answer starts and each
  completion holding the assistant turn(s). The prompt is rendered with the generation prompt, and
  prompt + completion as one conversation, with the checkpoint's chat template (`chat_template.py`,
  the renderer SFT uses), with the record's `tools` when it offers some.

The completion's tokens are those after the prompt's: as TRL does, the prompt is the longest common
prefix of the prompt's ids and each whole sequence's ids (a template may render a prompt alone
slightly differently from the same prompt followed by an answer, or a token may merge across the
boundary), and each completion is the rest of its sequence, through whatever the template writes after
the turn. Only completion tokens are scored.

A record that is not a preference pair stops the run with one line naming the record (its file and
line), what is wrong and what is allowed: a missing field, mixed shapes, a completion that is not an
assistant turn, or identical chosen and rejected completions (a pair that prefers nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from titan_tpu.data.chat_masks import OffsetTokenizer, check_messages, common_prefix
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError, Message
from titan_tpu.data.sft_examples import with_record_tools

TOOLS_FIELD = "tools"  # as TRL's datasets name the JSON schemas a conversation offers


@dataclass(frozen=True)
class PreferenceFields:
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclass(frozen=True)
class PreferencePair:
    """A pair's ids: the shared prompt, then each completion (TRL's prompt_ids / chosen_ids / rejected_ids)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def _field(record: Mapping[str, Any], name: str, where: str, fields: PreferenceFields) -> Any:
    if name not in record or record[name] is None:
        present = ", ".join(sorted(map(str, record))) or "no fields"
        raise ChatTemplateError(
            f"{where}: no '{name}' field (the record has {present}); a preference record has "
            f"'{fields.prompt}', '{fields.chosen}' and '{fields.rejected}' (strings, or lists of turns); "
            "set dpo.prompt_field, dpo.chosen_field and dpo.rejected_field to your names"
        )
    return record[name]


def _completion_turns(turns: Any, name: str, where: str) -> list[Message]:
    check_messages(turns, f"{where}: '{name}'")
    if turns[0]["role"] != "assistant":
        raise ChatTemplateError(
            f"{where}: '{name}' starts with a {turns[0]['role']!r} turn; a completion is the assistant's answer "
            "(its first turn has role 'assistant'), the conversation before it goes in the prompt"
        )
    return turns


class PreferenceEncoder:
    """Records -> `PreferencePair`s with one checkpoint's tokenizer and chat template."""

    def __init__(
        self,
        tokenizer: OffsetTokenizer,
        template: ChatTemplate,
        fields: PreferenceFields,
        switches: Mapping[str, Any],
    ) -> None:
        self.tokenizer, self.template, self.fields, self.switches = tokenizer, template, fields, dict(switches)

    def encode(self, record: Mapping[str, Any], where: str) -> PreferencePair:
        fields = self.fields
        prompt = _field(record, fields.prompt, where, fields)
        chosen = _field(record, fields.chosen, where, fields)
        rejected = _field(record, fields.rejected, where, fields)
        if chosen == rejected:
            raise ChatTemplateError(
                f"{where}: '{fields.chosen}' and '{fields.rejected}' are identical; a preference pair needs two "
                "different completions (leave such records out)"
            )
        if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
            if record.get(TOOLS_FIELD) is not None:
                raise ChatTemplateError(
                    f"{where}: '{TOOLS_FIELD}' are rendered with a conversation; this record's fields are plain "
                    "strings, which are tokenized without the chat template"
                )
            sequences = self._text(prompt, chosen, rejected, where)
        elif isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list):
            sequences = self._conversation(prompt, chosen, rejected, record, where)
        else:
            kinds = ", ".join(type(value).__name__ for value in (prompt, chosen, rejected))
            raise ChatTemplateError(
                f"{where}: '{fields.prompt}', '{fields.chosen}' and '{fields.rejected}' must be three strings or "
                f"three lists of turns, got {kinds}"
            )
        prompt_ids, chosen_ids, rejected_ids = sequences
        shared = min(common_prefix(prompt_ids, chosen_ids), common_prefix(prompt_ids, rejected_ids))
        pair = PreferencePair(prompt_ids[:shared], chosen_ids[shared:], rejected_ids[shared:])
        if not pair.chosen or not pair.rejected:
            empty = fields.chosen if not pair.chosen else fields.rejected
            raise ChatTemplateError(f"{where}: '{empty}' renders to no tokens after the prompt; nothing to score")
        return pair

    def _text(self, prompt: str, chosen: str, rejected: str, where: str) -> tuple[list[int], ...]:
        eos = self.template.tokens.get("eos_token")
        if eos is None:
            raise ChatTemplateError(
                f"{where}: the checkpoint's tokenizer_config.json names no eos_token to end a completion"
            )
        prefix = (self.template.tokens.get("bos_token") or "") + prompt
        encode = self.tokenizer.encode
        ends = [text if text.endswith(eos) else text + eos for text in (chosen, rejected)]
        return encode(prefix), encode(prefix + ends[0]), encode(prefix + ends[1])

    def _conversation(
        self, prompt: list[Any], chosen: list[Any], rejected: list[Any], record: Mapping[str, Any], where: str
    ) -> tuple[list[int], ...]:
        fields = self.fields
        check_messages(prompt, f"{where}: '{fields.prompt}'")
        chosen_turns = _completion_turns(chosen, fields.chosen, where)
        rejected_turns = _completion_turns(rejected, fields.rejected, where)
        switches = with_record_tools(record, where, TOOLS_FIELD, self.switches, "dpo.template_switches")
        render, encode = self.template.render, self.tokenizer.encode
        try:
            return (
                encode(render(prompt, add_generation_prompt=True, **switches)),
                encode(render([*prompt, *chosen_turns], **switches)),
                encode(render([*prompt, *rejected_turns], **switches)),
            )
        except ChatTemplateError as err:
            raise ChatTemplateError(f"{where}: {err}") from None
