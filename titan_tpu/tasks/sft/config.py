"""Supervised fine-tuning's `[sft]` section: which records, which tokens are trained on, packing, and
the generated answers of its evaluation. Imports nothing but the configuration, so the loader reads it
before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import opt, opt_table, require

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig


@dataclass
class SftConfig:
    dataset: Literal["data", "generated"] = opt(
        "data",
        "data: the records data.source and data.path name (.jsonl/.parquet files, or an offline Hugging "
        "Face dataset); generated: a generated chat task (no download) for the debug config and tests.",
    )
    train_on: Literal["assistant", "last_assistant", "completion", "all"] = opt(
        "assistant",
        "Tokens the loss trains on: every assistant turn (with its end-of-turn token), the last one, "
        "the completion of prompt/completion records, or all tokens.",
    )
    packing: bool = opt(
        True, "Pack examples one after another into rows of training.seq_len; false pads one example per row."
    )
    overflow: Literal["truncate", "drop"] = opt(
        "truncate", "An example longer than a row: keep its first seq_len + 1 tokens, or leave it out."
    )
    messages_field: str = opt("messages", "Record field holding a conversation (a list of role/content turns).")
    prompt_field: str = opt("prompt", "Record field holding the prompt of prompt/completion records.")
    completion_field: str = opt("completion", "Record field holding the completion of prompt/completion records.")
    template_switches: dict[str, Any] = opt_table(
        "Variables the chat template reads, e.g. { enable_thinking = false } for Qwen 3."
    )
    generated_examples: int = opt(4096, "generated: conversations in the training set.")
    generated_held_out: int = opt(256, "generated: conversations kept apart for validation and generation.")
    eval_generations: int = opt(
        16,
        "At each evaluation, greedily answer the last user turn of this many held-out conversations and "
        "report the share answered exactly; 0 = none.",
    )
    max_new_tokens: int = opt(64, "Longest generated answer in evaluations, in tokens.")

    def validate(self) -> None:
        for key in ("messages_field", "prompt_field", "completion_field"):
            require(bool(getattr(self, key)), f"sft.{key}", "must not be empty")
        require(self.generated_examples >= 1, "sft.generated_examples", f"must be >= 1, got {self.generated_examples}")
        require(self.generated_held_out >= 1, "sft.generated_held_out", f"must be >= 1, got {self.generated_held_out}")
        require(self.eval_generations >= 0, "sft.eval_generations", f"must be >= 0, got {self.eval_generations}")
        require(self.max_new_tokens >= 1, "sft.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")

    def generates(self, config: TrainConfig) -> bool:
        """Whether evaluations generate answers (they run only with metrics.eval_freq > 0)."""
        return self.eval_generations > 0 and config.metrics.eval_freq > 0

    def check_with(self, config: TrainConfig) -> None:
        """The [data] and [validation] values this task reads, against sft.dataset: a path the
        generated task would not read, a held-out source that does not exist for the user's records."""
        data, validation = config.data, config.validation
        require(
            data.text_field == "text",
            "data.text_field",
            "is the text of pretraining records; SFT reads sft.messages_field (or sft.prompt_field and "
            "sft.completion_field)",
        )
        require(
            not data.document_mask,
            "data.document_mask",
            "is for packed pretraining text; SFT keeps packed examples apart by itself (sft.packing); remove it",
        )
        if self.dataset == "generated":
            require(
                data.source == "embedded" and not data.path,
                "data.path" if data.path else "data.source",
                f"{data.path or data.source!r} is not read while sft.dataset = 'generated' (the built-in "
                "generated chat task); set sft.dataset = 'data' to train on your records",
            )
        else:
            require(
                data.source != "embedded",
                "data.source",
                "'embedded' is pretraining text; sft.dataset = 'data' reads records: set data.source = 'files' "
                "(or 'huggingface') and data.path",
            )
            for key in ("generated_examples", "generated_held_out"):
                require(
                    getattr(self, key) == SftConfig.__dataclass_fields__[key].default,
                    f"sft.{key}",
                    "is read only with sft.dataset = 'generated'; remove it or set sft.dataset = 'generated'",
                )
        readers = [
            reader
            for reader, reads in (
                ("validation.enable = true", validation.enable),
                (f"sft.eval_generations = {self.eval_generations}", self.generates(config)),
            )
            if reads
        ]
        if validation.source == "generated" and self.dataset != "generated" and readers:
            raise ConfigError(
                "validation.source: 'generated' is the held-out part of sft.dataset = 'generated', not of your "
                f"records, and {' and '.join(readers)} {'read' if len(readers) > 1 else 'reads'} held-out "
                "conversations; set validation.source = "
                "'files' with validation.path = HELD_OUT.jsonl, or set validation.enable = false and "
                "sft.eval_generations = 0"
            )
        if validation.source != "generated" and not validation.path and self.generates(config):
            raise ConfigError(
                f"sft.eval_generations: {self.eval_generations} held-out conversations are answered at each "
                "evaluation, from validation.path, which is empty; set validation.path, or sft.eval_generations = 0"
            )
