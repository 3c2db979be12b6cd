"""Hugging Face folders as transformers writes them: a tiny model of an architecture, built by
`AutoModelForCausalLM.from_config` at the hf family's debug sizes and saved with `save_pretrained`,
so the folder holds the checkpoint format the Hub publishes (per-expert tensors, the checkpoint's own
names), not our runtime names."""

from __future__ import annotations

from pathlib import Path

import torch

# The published MoE families of the issue that made the hf family read transformers' format
# (mixtral: block_sparse_moe.experts.K.w1; olmoe, qwen 2/3 moe: mlp.experts.K.gate_proj; granitemoe:
# block_sparse_moe.input_linear), by their causal-LM classes.
PUBLISHED_MOE = {
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
}

# A dense model whose folder fuses what its runtime splits: HRM's `attn.gqkv_proj` is chunked into
# four projections, `mlp.gate_up_proj` into two (several of our tensors read one folder tensor).
FUSED_DENSE = {"hrm_text": "HrmTextForCausalLM"}


def saved_folder(architecture: str, folder: Path, seed: int = 0) -> Path:
    """`folder` holding a freshly initialised tiny `architecture`, saved by transformers."""
    import transformers

    from titan_tpu.models.hf.args import shrink_to_debug_sizes

    cls = getattr(transformers, architecture)
    config = shrink_to_debug_sizes(cls.config_class())
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder
