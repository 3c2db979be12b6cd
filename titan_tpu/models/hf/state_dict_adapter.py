"""The hf family <-> its own Hugging Face folder: the weights are transformers' own under an `hf.`
prefix, so names map one to one, and the config is the model's config (with its architecture)."""

from __future__ import annotations

from typing import Any

from titan_tpu.models.hf.args import HFArgs

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

    def hf_tensors(self, name: str, shape: tuple[int, ...]) -> tuple[list[str], int | None]:
        return [name.removeprefix(PREFIX)], None

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
