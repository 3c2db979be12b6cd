"""Parameter counts and training FLOPs per token of an hf model, from its config and its modules
built on `meta` (so every architecture is counted the same way, whatever its projections are named).

The convention is our families' (`decoder_training_flops_per_token`): 6 N + 12 x attention, with N
the parameters a token passes through except the input embedding (the head counted also when tied),
a mixture of experts' expert weights scaled by top_k / experts, and attention's term summed over the
layers, each over the keys it attends to: the sequence, or a sliding window's width where shorter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from titan_tpu.models.common.flops import TRAINING_PASSES
from titan_tpu.models.hf.args import HFArgs
from titan_tpu.models.hf.model import build_hf_model

if TYPE_CHECKING:  # transformers is imported where a model is built
    from transformers import PreTrainedModel

_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class HFParamCount:
    total: int  # every trainable tensor once (a tied head adds nothing)
    active_non_embedding: int  # N of the convention


@functools.lru_cache(maxsize=8)
def meta_hf_model(args: HFArgs) -> PreTrainedModel:
    """transformers' model of `args` built on `meta`, once per arguments: the counts here and the
    planner's (titan_tpu/models/hf/planning.py) read it for every layout a search tries."""
    with torch.device("meta"):
        return build_hf_model(args)


def hf_param_count(args: HFArgs) -> HFParamCount:
    model = meta_hf_model(args)
    # The input embedding's tables: one, or one per codebook (MusicGen's list of them).
    embedding = {id(p): p for p in model.get_input_embeddings().parameters()}
    head = model.get_output_embeddings()
    top_k, experts = getattr(args.text_config, "num_experts_per_tok", None), _expert_count(args)
    total = active = 0
    for name, param in model.named_parameters():  # each tensor once: a tied head is not listed again
        total += param.numel()
        if id(param) in embedding:
            continue
        if ".experts." in f".{name}" and top_k and experts:  # routed: a token passes top_k of them
            active += param.numel() * top_k // experts
        else:
            active += param.numel()
    if head is not None:
        # A head tied to the embedding: the output matmul is computed either way.
        active += sum(p.numel() for p in head.parameters() if id(p) in embedding)
    return HFParamCount(total, active)


def _expert_count(args: HFArgs) -> int | None:
    for key in _EXPERT_COUNTS:
        value = getattr(args.text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def layer_configs(args: HFArgs) -> list[Any]:
    """Each decoder layer's config: the text config itself, or, in a heterogeneous config (Gemma 4's
    wider full-attention heads, Dots3's per-layer head counts), that layer's own view, since reading
    a per-layer field off the whole config raises."""
    config = args.text_config
    layers = int(config.num_hidden_layers)
    if getattr(config, "is_heterogeneous", False):
        return [config.per_layer_config[i] for i in range(layers)]
    return [config] * layers


def attention_context(args: HFArgs, seq_len: int) -> list[int]:
    """Keys each layer's queries are charged for: the sequence, or a sliding window where shorter."""
    layers = layer_configs(args)
    types = getattr(args.text_config, "layer_types", None)
    keys = []
    for i, layer in enumerate(layers):
        window = getattr(layer, "sliding_window", None)
        kind = types[i] if types else ("sliding_attention" if window else "full_attention")
        keys.append(min(seq_len, window) if kind == "sliding_attention" and window else seq_len)
    return keys


def hf_flops_per_token(args: HFArgs, seq_len: int) -> float:
    attention = 0.0
    for layer, keys in zip(layer_configs(args), attention_context(args, seq_len)):
        heads = int(layer.num_attention_heads)
        head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
        attention += 4.0 * heads * head_dim * keys
    return TRAINING_PASSES * (2.0 * hf_param_count(args).active_non_embedding + attention)
