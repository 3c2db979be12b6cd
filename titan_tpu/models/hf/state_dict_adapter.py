"""The hf family <-> Hugging Face folders: the weights are transformers' runtime tensors under an `hf.`
prefix, read from and written to the checkpoint format transformers saves and the Hub publishes,
through transformers' own conversion for the model type (conversion.py: per-expert tensors fused,
renamed keys); the config is the model's config (with its architecture)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from titan_tpu.models.hf import conversion
from titan_tpu.models.hf.args import HFArgs
from titan_tpu.protocols.state_dict_adapter import ImportPlan, Shapes
from titan_tpu.protocols.tensor_layout import BlockLayout

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PREFIX = "hf."
# Config fields that decide the weights' meaning beyond their shapes (the shapes are checked
# tensor by tensor when the weights load); compared where both sides have them.
COMPARED = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
)


class HFFamilyAdapter:
    weights_stem = "model"
    config_dtype_keys = ("dtype", "torch_dtype")

    def meta_model(self, args: HFArgs) -> PreTrainedModel:
        """transformers' model for `args` on `meta`: what its conversion mapping is looked up by."""
        from titan_tpu.models.hf.model import build_hf_model

        with torch.device("meta"):
            return build_hf_model(args)

    def import_layouts(self, args: HFArgs, shapes: Shapes, available: Shapes) -> ImportPlan:
        return conversion.import_plan(self.meta_model(args), available, PREFIX)

    def export_layouts(self, args: HFArgs, shapes: Shapes) -> dict[str, BlockLayout]:
        return conversion.export_layouts(self.meta_model(args), shapes, PREFIX)

    def to_hf_config(self, args: HFArgs) -> dict[str, Any]:
        config = args.config.to_dict()
        config["architectures"] = [args.architecture]
        return config

    def check_hf_config(self, config: dict[str, Any], args: HFArgs) -> list[str]:
        ours = args.config.to_dict()
        # Where both say: a folder may leave out what its config class derives (Mistral 7B v0.1's
        # config.json has no head_dim; the class computes 128).
        problems = [
            f"{key} is {config[key]!r} there, {ours[key]!r} here"
            for key in COMPARED
            if config.get(key) is not None and ours.get(key) is not None and config[key] != ours[key]
        ]
        theirs = (config.get("architectures") or [None])[0]
        if theirs != args.architecture:
            problems.append(f"architectures[0] is {theirs!r} there, {args.architecture!r} here")
        return problems


HF_FAMILY_ADAPTER = HFFamilyAdapter()
