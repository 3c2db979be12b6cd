"""Where preference training's pairs come from and how a record becomes ids.

Training pairs: `dpo.dataset = "generated"` (data/preference_generated.py), else `data.source` files
or an offline Hugging Face dataset. Held-out pairs: `validation.source`, where "generated" is the
generated task's held-out split. Every record is rendered with the chat template of the tokenizer's
folder (or `data.chat_template`) and that folder's special tokens, the renderer SFT uses.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.chat_template import ChatTemplate
from titan_tpu.data.chat_tokenizer import tokenizer_folder
from titan_tpu.data.preference_dataset import Fitting
from titan_tpu.data.preference_generated import GeneratedPreferences
from titan_tpu.data.preference_records import PreferenceEncoder, PreferenceFields
from titan_tpu.data.sft_dataset import RecordSource
from titan_tpu.data.sft_records import FileRecords, HuggingFaceRecords
from titan_tpu.data.tokenizer import HFTokenizer, build_tokenizer
from titan_tpu.tasks.dpo.config import DpoConfig


def fields_of(dpo: DpoConfig) -> PreferenceFields:
    return PreferenceFields(dpo.prompt_field, dpo.chosen_field, dpo.rejected_field)


def training_records(config: TrainConfig) -> RecordSource:
    dpo, data = config.section(DpoConfig), config.data
    if dpo.dataset == "generated":
        return GeneratedPreferences(config.training.seed, "train", dpo.generated_pairs, fields_of(dpo))
    if data.source == "files":
        return FileRecords(data.path)
    # data.source = 'embedded' is refused when the config is checked (DpoConfig.check_with).
    return HuggingFaceRecords(data.path, data.hf_split)


def held_out_records(config: TrainConfig) -> RecordSource:
    dpo, validation = config.section(DpoConfig), config.validation
    if validation.source == "generated":
        # With dpo.dataset = 'data' this is refused when the config is checked (DpoConfig.check_with).
        return GeneratedPreferences(config.training.seed, "held_out", dpo.generated_held_out, fields_of(dpo))
    if validation.source == "files":
        return FileRecords(validation.path, "validation.path")
    return HuggingFaceRecords(validation.path, validation.hf_split, "validation.path")


@dataclasses.dataclass(frozen=True)
class PreferenceEncoding:
    """The run's tokenizer, its records' encoder, and the id that pads rows (the template's pad token,
    else end of text)."""

    tokenizer: HFTokenizer
    encoder: PreferenceEncoder
    pad_id: int


def preference_encoding(config: TrainConfig) -> PreferenceEncoding:
    data, dpo = config.data, config.section(DpoConfig)
    tokenizer = build_tokenizer(data.tokenizer)
    if not isinstance(tokenizer, HFTokenizer):  # 'byte' is refused by DpoConfig.check_with
        raise ConfigError("data.tokenizer: DPO needs a checkpoint's tokenizer folder or 'chatml_bytes'")
    template = ChatTemplate.from_folder(tokenizer_folder(data.tokenizer), data.chat_template or None)
    pad = template.tokens.get("pad_token")
    pad_id = tokenizer.token_to_id(pad) if pad is not None else None
    encoder = PreferenceEncoder(tokenizer, template, fields_of(dpo), dpo.template_switches)
    return PreferenceEncoding(tokenizer, encoder, tokenizer.eos_id if pad_id is None else pad_id)


def fitting_of(config: TrainConfig, pad_id: int, shuffle: bool) -> Fitting:
    data, dpo = config.data, config.section(DpoConfig)
    return Fitting(
        config.training.seq_len,
        pad_id,
        dpo.overflow,
        data.shuffle_buffer,
        shuffle and data.shuffle,
        config.training.seed,
    )


def fingerprint(config: TrainConfig, encoder: PreferenceEncoder) -> dict[str, Any]:
    """What the saved data position means beyond the fitting: resuming with other records, fields or
    template would silently read other data."""
    dpo, data = config.section(DpoConfig), config.data
    return {
        "dataset": dpo.dataset,
        "source": data.source,
        "path": data.path,
        "fields": [dpo.prompt_field, dpo.chosen_field, dpo.rejected_field],
        "switches": sorted(map(str, dpo.template_switches.items())),
        "generated_pairs": dpo.generated_pairs if dpo.dataset == "generated" else None,
        "template_sha256": hashlib.sha256(encoder.template.source.encode()).hexdigest()[:16],
    }
