"""Llama 3 <-> Hugging Face transformers `LlamaForCausalLM`: the shared decoder adapter
(`titan_tpu.models.common.hf_adapter`, which also says why no q/k permutation is needed) with Llama's dense
SwiGLU config keys."""

from __future__ import annotations

from typing import Any

from titan_tpu.models.common.hf_adapter import DecoderHFAdapter
from titan_tpu.models.llama3.args import Llama3Args


class Llama3StateDictAdapter(DecoderHFAdapter[Llama3Args]):
    family = "Llama 3"

    def hf_model_type(self, args: Llama3Args) -> str:
        return "llama"

    def hf_architecture(self, args: Llama3Args) -> str:
        return "LlamaForCausalLM"

    def feed_forward_config(self, args: Llama3Args) -> dict[str, Any]:
        return {"intermediate_size": args.ffn_hidden_dim, "mlp_bias": False}

    def compared_fields(self, config: dict[str, Any], args: Llama3Args) -> dict[str, tuple[Any, Any]]:
        fields = super().compared_fields(config, args)
        fields["intermediate_size"] = (config.get("intermediate_size"), args.ffn_hidden_dim)
        return fields

    def family_problems(self, config: dict[str, Any], args: Llama3Args) -> list[str]:
        problems = super().family_problems(config, args)
        if config.get("mlp_bias"):
            problems.append("mlp_bias is true; Llama 3 has no biases")
        return problems


LLAMA3_STATE_DICT_ADAPTER = Llama3StateDictAdapter()
