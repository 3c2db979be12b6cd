"""Parameter counts and training FLOPs per token of an hf model, from its config and its modules
built on `meta` (so every architecture is counted the same way, whatever its projections are named).

The convention is our families' (`decoder_training_flops_per_token`): 6 N + 12 x attention, with N
the parameters a token passes through except the input embedding (the head counted also when tied),
a mixture of experts' expert weights scaled by top_k / experts, and attention's term summed over the
layers, each over the keys it attends to: the sequence, or a sliding window's width where shorter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_tpu.models.common.flops import TRAINING_PASSES
from titan_tpu.models.hf.args import HFArgs
from titan_tpu.models.hf.model import build_hf_model

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class HFParamCount:
    total: int  # every trainable tensor once (a tied head adds nothing)
    active_non_embedding: int  # N of the convention


def hf_param_count(args: HFArgs) -> HFParamCount:
    with torch.device("meta"):
        model = build_hf_model(args)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    top_k, experts = getattr(args.config, "num_experts_per_tok", None), _expert_count(args)
    total = active = 0
    for name, param in model.named_parameters():  # each tensor once: a tied head is not listed again
        total += param.numel()
        if param is embedding:
            continue
        routed = ".experts." in f".{name}" and top_k and experts
        active += param.numel() * top_k // experts if routed else param.numel()
    if head is not None and head.weight is embedding:
        active += embedding.numel()  # the output matmul is computed either way
    return HFParamCount(total, active)


def _expert_count(args: HFArgs) -> int | None:
    for key in _EXPERT_COUNTS:
        value = getattr(args.config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def attention_context(args: HFArgs, seq_len: int) -> list[int]:
    """Keys each layer's queries are charged for: the sequence, or a sliding window where shorter."""
    config = args.config
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
    return [min(seq_len, window) if kind == "sliding_attention" and window else seq_len for kind in types[:layers]]


def hf_flops_per_token(args: HFArgs, seq_len: int) -> float:
    config = args.config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = sum(4.0 * heads * head_dim * keys for keys in attention_context(args, seq_len))
    return TRAINING_PASSES * (2.0 * hf_param_count(args).active_non_embedding + attention)
