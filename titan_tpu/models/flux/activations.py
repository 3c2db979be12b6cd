"""Bytes per token a FLUX block keeps for backward (the planner's activation estimate; convention in
titan_tpu/plan/activations.py). Not measured; an estimate of the same kind as the decoders'."""

from __future__ import annotations

from titan_tpu.models.flux.args import FluxArgs
from titan_tpu.protocols.planning import FLOAT32, ActivationGeometry, BlockActivations


def flux_block_activations(args: FluxArgs, g: ActivationGeometry) -> BlockActivations:
    """A double- or single-stream block over the joint image + text sequence: two float32 LayerNorm
    inputs and modulated outputs (2 (4 + a) d), q, k, v, the attention output and projection input
    (5 d a) and the MLP's input, GELU and output (3 F a). FLUX has no tensor-parallel plan, so
    nothing is split over tp."""
    a, d, hidden = g.act_bytes, args.dim, args.mlp_hidden_dim
    full = 2 * (FLOAT32 + a) * d + 5 * d * a + 3 * hidden * a
    matmuls = 5 * d * a + hidden * a + d * a
    return BlockActivations(full, matmuls, d * a, hidden * a + 2 * d * a)
