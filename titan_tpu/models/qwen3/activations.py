"""Bytes per token a Qwen 3 MoE block keeps for backward (the planner's activation estimate;
convention in titan_tpu/plan/activations.py, the shared attention part in
titan_tpu/models/common/decoder_activations.py). The dense Qwen 3 block is the shared dense decoder's."""

from __future__ import annotations

from titan_tpu.models.common.decoder_activations import FeedForwardActivations, decoder_block_activations
from titan_tpu.models.qwen3.args import Qwen3MoeArgs
from titan_tpu.protocols.planning import FLOAT32, ActivationGeometry, BlockActivations


def moe_activations(args: Qwen3MoeArgs, g: ActivationGeometry) -> FeedForwardActivations:
    """Replicated over tp, on the full sequence: router logits and float32 probabilities
    ((a + 4) E), each token's k routed copies going in and out of the experts (3 k d a) and the
    experts' SwiGLU on them (4 k F_moe a); capacity padding is not counted."""
    a, k, experts, hidden = g.act_bytes, args.top_k, args.num_experts, args.moe_hidden_dim
    kept = (a + FLOAT32) * experts + 3 * k * args.dim * a + 4 * k * hidden * a
    matmuls = (experts + 2 * k * hidden + k * args.dim) * a
    return FeedForwardActivations(kept, k * hidden * a, matmuls)


def qwen3_moe_block_activations(args: Qwen3MoeArgs, g: ActivationGeometry) -> BlockActivations:
    return decoder_block_activations(args, g, moe_activations(args, g))
