"""Preference training's `[dpo]` section: which pairs, how they are read, and the objective (TRL's
DPOTrainer's loss types, beta and label smoothing). Imports nothing but the configuration, so the
loader reads it before torch loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import opt, opt_table, require

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig

LossType = Literal["sigmoid", "robust", "ipo", "hinge"]
# The loss types that read dpo.label_smoothing.
SMOOTHED = ("sigmoid", "robust")


@dataclass
class DpoConfig:
    dataset: Literal["data", "generated"] = opt(
        "data",
        "data: the preference records data.source and data.path name (.jsonl/.parquet files, or an offline "
        "Hugging Face dataset); generated: generated sums with a right and a wrong answer (no download).",
    )
    prompt_field: str = opt("prompt", "Record field holding the prompt (a string, or a list of turns).")
    chosen_field: str = opt("chosen", "Record field holding the preferred completion (a string, or assistant turns).")
    rejected_field: str = opt("rejected", "Record field holding the other completion (a string, or assistant turns).")
    template_switches: dict[str, Any] = opt_table(
        "Variables the chat template reads, e.g. { enable_thinking = false } for Qwen 3."
    )
    overflow: Literal["truncate", "refuse"] = opt(
        "truncate",
        "A sequence (prompt + completion) longer than training.seq_len: keep its first seq_len tokens, as TRL's "
        "max_length does (a pair whose prompt alone fills it is left out), or stop the run naming the record.",
    )
    loss_type: LossType = opt(
        "sigmoid",
        "sigmoid: DPO; robust: robust DPO (label_smoothing = the share of flipped labels); ipo: IPO on "
        "log-probabilities averaged per completion token; hinge: SLiC's hinge loss. As TRL's DPOTrainer.",
    )
    beta: float = opt(
        0.1,
        "Strength of the pull toward the reference model (IPO: the regularisation tau); the rewards are "
        "beta x (policy - reference) log-probability of a completion.",
    )
    label_smoothing: float = opt(
        0.0,
        "Assumed share of pairs whose preference is wrong, in [0, 0.5): sigmoid becomes conservative DPO "
        "(cDPO), robust robust DPO; other loss types read none.",
    )
    generated_pairs: int = opt(4096, "generated: pairs in the training set.")
    generated_held_out: int = opt(512, "generated: pairs kept apart for the held-out evaluation.")

    def validate(self) -> None:
        for key in ("prompt_field", "chosen_field", "rejected_field"):
            require(bool(getattr(self, key)), f"dpo.{key}", "must not be empty")
        fields = [self.prompt_field, self.chosen_field, self.rejected_field]
        require(len(set(fields)) == 3, "dpo.rejected_field", f"the three fields must differ, got {fields}")
        require(self.beta > 0, "dpo.beta", f"must be > 0, got {self.beta}")
        require(
            0.0 <= self.label_smoothing < 0.5,
            "dpo.label_smoothing",
            f"must be in [0, 0.5) (the share of flipped preferences), got {self.label_smoothing}",
        )
        if self.loss_type not in SMOOTHED:
            require(
                self.label_smoothing == 0.0,
                "dpo.label_smoothing",
                f"is read by loss_type 'sigmoid' and 'robust', not {self.loss_type!r}; remove it",
            )
        require(self.generated_pairs >= 1, "dpo.generated_pairs", f"must be >= 1, got {self.generated_pairs}")
        require(self.generated_held_out >= 1, "dpo.generated_held_out", f"must be >= 1, got {self.generated_held_out}")

    def check_with(self, config: TrainConfig) -> None:
        """The [data] and [validation] values this task reads, against dpo.dataset."""
        data, validation = config.data, config.validation
        require(
            data.text_field == "text" and not data.document_mask,
            "data.text_field" if data.text_field != "text" else "data.document_mask",
            "is for pretraining text; DPO reads dpo.prompt_field, dpo.chosen_field and dpo.rejected_field, one "
            "pair per row; remove it",
        )
        require(
            data.tokenizer != "byte",
            "data.tokenizer",
            "DPO renders pairs with a chat template and its special tokens; use a checkpoint's tokenizer "
            "folder or 'chatml_bytes'",
        )
        if self.dataset == "generated":
            require(
                data.source == "embedded" and not data.path,
                "data.path" if data.path else "data.source",
                f"{data.path or data.source!r} is not read while dpo.dataset = 'generated' (generated sums); set "
                "dpo.dataset = 'data' to train on your records",
            )
        else:
            require(
                data.source != "embedded",
                "data.source",
                "'embedded' is pretraining text; dpo.dataset = 'data' reads preference records: set data.source = "
                "'files' (or 'huggingface') and data.path",
            )
            for key in ("generated_pairs", "generated_held_out"):
                require(
                    getattr(self, key) == DpoConfig.__dataclass_fields__[key].default,
                    f"dpo.{key}",
                    "is read only with dpo.dataset = 'generated'; remove it or set dpo.dataset = 'generated'",
                )
        if validation.enable and validation.source == "generated" and self.dataset != "generated":
            raise ConfigError(
                "validation.source: 'generated' is the held-out part of dpo.dataset = 'generated', not of your "
                "records; set validation.source = 'files' with validation.path = HELD_OUT.jsonl"
            )
