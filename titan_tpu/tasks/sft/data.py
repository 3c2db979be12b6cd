"""Where the fine-tuning task's records come from and how one becomes ids and a loss mask.

Training records: `sft.dataset = "generated"` (data/generated_chat.py), else `data.source` files or
an offline Hugging Face dataset. Held-out records: `validation.source`, where "generated" is the
generated task's held-out split. Every record is rendered with the chat template of the tokenizer's
folder (or `data.chat_template`), with the special tokens of that folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.chat_masks import MaskedTokens, TrainOn, end_of_turn
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.chat_tokenizer import tokenizer_folder
from titan_tpu.data.generated_chat import GeneratedChat
from titan_tpu.data.sft_dataset import Packing, RecordSource
from titan_tpu.data.sft_examples import RecordFields, record_tokens
from titan_tpu.data.sft_records import FileRecords, HuggingFaceRecords
from titan_tpu.data.tokenizer import HFTokenizer, build_tokenizer
from titan_tpu.tasks.sft.config import SftConfig


def training_records(config: TrainConfig) -> RecordSource:
    sft, data = config.section(SftConfig), config.data
    if sft.dataset == "generated":
        return GeneratedChat(config.training.seed, "train", sft.generated_examples, sft.messages_field)
    if data.source == "files":
        return FileRecords(data.path)
    # data.source = 'embedded' is refused when the config is checked (SftConfig.check_with).
    return HuggingFaceRecords(data.path, data.hf_split)


def held_out_records(config: TrainConfig) -> RecordSource:
    sft, validation = config.section(SftConfig), config.validation
    if validation.source == "generated":
        # With sft.dataset = 'data' this is refused when the config is checked (SftConfig.check_with).
        return GeneratedChat(config.training.seed, "held_out", sft.generated_held_out, sft.messages_field)
    if validation.source == "files":
        return FileRecords(validation.path, "validation.path")
    return HuggingFaceRecords(validation.path, validation.hf_split, "validation.path")


@dataclasses.dataclass(frozen=True)
class ChatEncoding:
    """The tokenizer and template of a run, and the ids the trainer and the sampler need."""

    tokenizer: HFTokenizer
    template: ChatTemplate
    fields: RecordFields
    train_on: TrainOn
    switches: Mapping[str, Any]
    pad_id: int
    stop_ids: tuple[int, ...]  # what ends a generated answer: the end-of-turn token, eos

    @classmethod
    def from_config(cls, config: TrainConfig) -> ChatEncoding:
        data, sft = config.data, config.section(SftConfig)
        tokenizer = build_tokenizer(data.tokenizer)
        if not isinstance(tokenizer, HFTokenizer):
            raise ConfigError(
                "data.tokenizer: fine-tuning needs a checkpoint's tokenizer folder (tokenizer.json with its "
                "tokenizer_config.json) or 'chatml_bytes', not 'byte'"
            )
        template = ChatTemplate.from_folder(tokenizer_folder(data.tokenizer), data.chat_template or None)
        switches = dict(sft.template_switches)

        def token_id(text: str | None) -> int | None:
            return None if text is None else tokenizer.token_to_id(text)

        eot_ids = tokenizer.encode(end_of_turn(template, **switches))
        eot = eot_ids[0] if len(eot_ids) == 1 else None
        stops = [i for i in (eot, token_id(template.tokens.get("eos_token")), tokenizer.eos_id) if i is not None]
        pad = token_id(template.tokens.get("pad_token"))
        fields = RecordFields(sft.messages_field, sft.prompt_field, sft.completion_field)
        return cls(
            tokenizer,
            template,
            fields,
            sft.train_on,
            switches,
            tokenizer.eos_id if pad is None else pad,
            tuple(dict.fromkeys(stops)),
        )

    def encode(self, record: dict[str, Any], where: str) -> MaskedTokens:
        """The record's ids and mask; any failure names the record (file and line)."""
        try:
            return record_tokens(
                record, where, self.fields, self.template, self.tokenizer, self.train_on, self.switches
            )
        except ChatTemplateError as err:
            if str(err).startswith(where):
                raise
            raise ChatTemplateError(f"{where}: {err}") from None


def packing_of(config: TrainConfig, encoding: ChatEncoding, shuffle: bool) -> Packing:
    data, sft = config.data, config.section(SftConfig)
    return Packing(
        config.training.seq_len,
        encoding.pad_id,
        sft.packing,
        sft.overflow,
        data.shuffle_buffer,
        shuffle and data.shuffle,
        config.training.seed,
    )


def fingerprint(config: TrainConfig, encoding: ChatEncoding) -> dict[str, Any]:
    """What the saved data position means beyond the packing: resuming with other records, mask or
    vocabulary would silently read other data."""
    sft, data = config.section(SftConfig), config.data
    return {
        "dataset": sft.dataset,
        "source": data.source,
        "path": data.path,
        "train_on": sft.train_on,
        "fields": [sft.messages_field, sft.prompt_field, sft.completion_field],
        "switches": sorted(map(str, sft.template_switches.items())),
        "generated_examples": sft.generated_examples if sft.dataset == "generated" else None,
        "vocab_size": encoding.tokenizer.vocab_size,
        "template_sha256": hashlib.sha256(encoding.template.source.encode()).hexdigest()[:16],
    }
