"""What the planner reads of an hf model (`ModelSpec.planning.block_activations`, `expert_routing`): the bytes
per token its decoder layers keep for backward, and its experts' routing, from the config and the
modules built on `meta`, each layer as it is: its attention widths and per-head norms, then a gated
or plain MLP of its width, or transformers' experts with any shared MLP beside them.

The counting convention is the native families' (titan_tpu/models/common/decoder_activations.py; the
experts' as Qwen 3 MoE's, titan_tpu/models/qwen3/activations.py), so an hf model and its native twin plan
alike. Under tensor parallelism the experts are replicated (titan_tpu/models/hf/parallelize.py), so their
activations and FLOPs are every tp rank's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import cast

from torch import nn

from titan_tpu.models.common.decoder_activations import (
    FeedForwardActivations,
    decoder_block_activations,
    swiglu_activations,
)
from titan_tpu.models.common.flops import TRAINING_PASSES
from titan_tpu.models.hf.args import HFArgs
from titan_tpu.models.hf.flops import layer_configs, meta_hf_model
from titan_tpu.models.hf.model import decoder_layers_path, is_experts_module
from titan_tpu.protocols.planning import FLOAT32, ActivationGeometry, BlockActivations, ExpertRouting

# Per-head norms of queries and keys (Qwen 3, OLMo 2, Gemma 3), by their module names.
QK_NORM_NAMES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as the activation count sees it (the attention fields are
    `decoder_block_activations`' names)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    attn_head_dim: int
    qk_norm: bool
    mlp_hidden: int  # a dense MLP's (or the shared experts') hidden width; 0 for none
    gated: bool  # whether that MLP is gated (SwiGLU-like: three matrices) or plain (two)
    experts: int  # transformers' experts in this layer; 0 for a dense layer
    expert_hidden: int
    expert_gated: bool
    top_k: int
    router_params: int


def _layer_shape(layer: nn.Module, config: object, dim: int, top_k: int) -> LayerShape:
    heads = int(config.num_attention_heads)  # type: ignore[attr-defined]  # every layer's config has it
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or dim // heads)
    names = dict(layer.named_modules())
    qk_norm = any(name.rpartition(".")[2] in QK_NORM_NAMES for name in names)
    experts = [module for module in layer.modules() if is_experts_module(module)]
    expert_ids = {id(p) for module in experts for p in module.parameters()}
    count = cast(int, experts[0].num_experts) if experts else 0  # an int: is_experts_module checked it
    expert_hidden, expert_gated = 0, True
    if experts:
        module = experts[0]
        expert_gated = bool(getattr(module, "has_gate", True))
        per_expert = sum(p.numel() for p in module.parameters(recurse=False)) // count
        expert_hidden = per_expert // ((3 if expert_gated else 2) * dim)
    # What is left of the layer beyond attention, experts, norms and the router is its MLP (or the
    # shared experts beside the routed ones).
    attention = {
        id(p) for name, module in names.items() if name.endswith(("attn", "attention")) for p in module.parameters()
    }
    router = [
        p for p in layer.parameters() if count and p.ndim == 2 and p.shape == (count, dim) and id(p) not in expert_ids
    ]
    router_ids = {id(p) for p in router}
    mlp = [
        (n, p)
        for n, p in layer.named_parameters()
        if p.ndim >= 2 and id(p) not in attention | expert_ids | router_ids and min(p.shape) > 1
    ]
    gated = any("gate" in name for name, _ in mlp)  # gate_proj, gate_up_proj (the router is left out)
    mlp_params = sum(p.numel() for _, p in mlp)
    return LayerShape(
        dim=dim,
        n_heads=heads,
        n_kv_heads=kv_heads,
        attn_head_dim=head_dim,
        qk_norm=qk_norm,
        mlp_hidden=mlp_params // ((3 if gated else 2) * dim),
        gated=gated,
        experts=count,
        expert_hidden=expert_hidden,
        expert_gated=expert_gated,
        top_k=top_k if count else 0,
        router_params=sum(p.numel() for p in router),
    )


@functools.lru_cache(maxsize=8)
def layer_shapes(args: HFArgs) -> tuple[LayerShape, ...]:
    """Every decoder layer's shape, read off the model built on `meta` (once per arguments: the
    planner's search asks for each layout)."""
    model = meta_hf_model(args)
    layers = cast(nn.ModuleList, model.get_submodule(decoder_layers_path(model)))  # the path is of a ModuleList
    top_k = int(getattr(args.text_config, "num_experts_per_tok", 0) or 0)
    return tuple(_layer_shape(layer, config, args.dim, top_k) for layer, config in zip(layers, layer_configs(args)))


def _feed_forward(shape: LayerShape, g: ActivationGeometry) -> FeedForwardActivations:
    a, t = g.act_bytes, g.tp
    parts: list[FeedForwardActivations] = []
    if shape.mlp_hidden:
        hidden = shape.mlp_hidden
        # A plain MLP keeps its up projection's output and the activation of it.
        parts.append(
            swiglu_activations(hidden, g)
            if shape.gated
            else FeedForwardActivations(2 * hidden * a / t, hidden * a / t, hidden * a / t)
        )
    if shape.experts:
        # Router logits and float32 probabilities, k routed copies in and out, the experts' MLP on
        # them (SwiGLU: 4 k F a; plain: 2 k F a); replicated over tp.
        k, hidden, experts = shape.top_k, shape.expert_hidden, shape.experts
        inner = 4 if shape.expert_gated else 2
        kept = (a + FLOAT32) * experts + 3 * k * shape.dim * a + inner * k * hidden * a
        parts.append(FeedForwardActivations(kept, k * hidden * a, (experts + 2 * k * hidden + k * shape.dim) * a))
    return FeedForwardActivations(
        sum(p.kept for p in parts), max((p.widest for p in parts), default=0.0), sum(p.matmuls for p in parts)
    )


def hf_block_activations(args: HFArgs, g: ActivationGeometry) -> BlockActivations:
    """Bytes per token of one decoder layer: the layers' mean (their total is what the planner
    multiplies out), the backward's widest of any layer."""
    per_layer = [decoder_block_activations(shape, g, _feed_forward(shape, g)) for shape in layer_shapes(args)]
    n = len(per_layer)
    return BlockActivations(
        full=sum(b.full for b in per_layer) / n,
        selective_op=sum(b.selective_op for b in per_layer) / n,
        checkpointed=sum(b.checkpointed for b in per_layer) / n,
        backward=max(b.backward for b in per_layer),
    )


def hf_expert_routing(args: HFArgs) -> ExpertRouting:
    """top_k and the training FLOPs per token of the routers and the top_k experts of every MoE
    layer (0 and 0 for a dense model)."""
    shapes = layer_shapes(args)
    params = sum(
        s.router_params + s.top_k * (3 if s.expert_gated else 2) * s.dim * s.expert_hidden for s in shapes if s.experts
    )
    top_k = max((s.top_k for s in shapes), default=0)
    return ExpertRouting(top_k=top_k, training_flops_per_token=TRAINING_PASSES * 2.0 * params)
