"""Bytes per token a decoder block keeps for backward (the planner's activation estimate; the counting
convention is in titan_tpu/plan/activations.py). a = bytes of the compute dtype, t = tp, t_sp = t
with sequence parallelism else 1.

Attention and the two RMSNorms are the same in every family built from `titan_tpu.models.common`; the
feed-forward is the family's (`swiglu_activations` for a dense SwiGLU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from titan_tpu.models.common.decoder_args import DecoderArgs
from titan_tpu.protocols.planning import FLOAT32, ActivationGeometry, BlockActivations


class AttentionShape(Protocol):
    """What the count reads of a block's attention (DecoderArgs has it; the hf family's layers too)."""

    @property
    def dim(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def attn_head_dim(self) -> int: ...
    @property
    def qk_norm(self) -> bool: ...


@dataclass(frozen=True)
class FeedForwardActivations:
    """Per token, bytes, of a block's feed-forward."""

    kept: float  # what it keeps for backward without recomputation
    widest: float  # its widest intermediate: the gradient backward holds for it
    matmuls: float  # its matmul outputs, kept under op-level selective checkpointing


def norm_activations(dim: int, g: ActivationGeometry) -> float:
    """An RMSNorm keeps its float32 input and normed output ((4 + a) d / t_sp: it runs on the
    sequence shard) and hands its projections a full-sequence input (a d, all-gathered under
    sequence parallelism)."""
    return (FLOAT32 + g.act_bytes) * dim / g.t_sp + g.act_bytes * dim


def swiglu_activations(hidden_dim: int, g: ActivationGeometry) -> FeedForwardActivations:
    """w1 x, silu(w1 x), w3 x and their product (4 F a / t), split over tp like its weights."""
    a, t = g.act_bytes, g.tp
    return FeedForwardActivations(4 * hidden_dim * a / t, hidden_dim * a / t, 2 * hidden_dim * a / t)


def decoder_block_activations(
    args: AttentionShape, g: ActivationGeometry, feed_forward: FeedForwardActivations
) -> BlockActivations:
    """Attention keeps q, the grouped-query k and v repeated to every head, and its output
    (4 H D a / t: the fused kernels keep no S x S matrix); per-head q/k norms add their float32
    input and output ((4 + a)(H + H_kv) D / t). Op-level selective checkpointing keeps the
    projections' outputs ((Q + 2 KV + H D) a / t), two residual-width tensors and the input."""
    a, t, d = g.act_bytes, g.tp, args.dim
    q_width = args.n_heads * args.attn_head_dim
    kv_width = args.n_kv_heads * args.attn_head_dim
    attention = 4 * q_width * a / t
    if args.qk_norm:
        attention += (FLOAT32 + a) * (q_width + kv_width) / t
    projections = (q_width + 2 * kv_width + q_width) * a / t + 2 * a * d
    full = 2 * norm_activations(d, g) + attention + feed_forward.kept
    checkpointed = a * d / g.t_sp
    backward = feed_forward.widest + 2 * checkpointed  # the residual stream's gradients are the input's shape
    return BlockActivations(full, projections + feed_forward.matmuls + checkpointed, checkpointed, backward)


def dense_decoder_activations(args: DecoderArgs, g: ActivationGeometry) -> BlockActivations:
    """A block with a dense SwiGLU of the args' `ffn_hidden_dim` (Llama 3, Qwen 3 dense)."""
    hidden: int = args.ffn_hidden_dim  # type: ignore[attr-defined]  # a dense family's args add it
    return decoder_block_activations(args, g, swiglu_activations(hidden, g))
