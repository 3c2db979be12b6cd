"""What context parallelism (`parallelism.cp`, titan_tpu/distributed/context_parallel.py) adds to
one device's activations, beyond the per-token count at S / cp tokens per sample.

Each cp rank runs the model on its S / cp tokens of every sample, so every per-token term of the
family's `block_activations` is simply counted at S / cp tokens (the planner's `Geometry`). Two
terms are not per token of the rank (a = bytes of the compute dtype, t = tp, d_kv = n_kv_heads x
head_dim):

- the gathered keys and values: attention (SDPA) keeps its key and value inputs for backward, and
  under cp those are the whole sequence's, S per sample instead of S / cp. Beyond the local ones
  the per-token count already has, a block keeps 2 (cp - 1) d_kv a / t per local token;
- the causal mask of the rank's queries against all keys, [S / cp, S] booleans, built once and
  shared by every layer (`ContextParallelAttention.masks`): S^2 / cp bytes.

The time of the per-layer K/V all-gather is in the step-time roofline (`roofline.cp_seconds`).
"""

from __future__ import annotations

import dataclasses

from titan_tpu.plan.activations import ActivationEstimate, Geometry
from titan_tpu.protocols.planning import BlockActivations


def with_gathered_kv(block: BlockActivations, kv_dim: int, g: Geometry, cp: int) -> BlockActivations:
    """`block`'s bytes per local token with the other cp ranks' keys and values that attention keeps
    (in every mode that keeps attention's inputs: all but a checkpointed block's input)."""
    gathered = 2 * (cp - 1) * kv_dim / g.tp * g.act_bytes
    return dataclasses.replace(block, full=block.full + gathered, selective_op=block.selective_op + gathered)


def with_mask(activations: ActivationEstimate, seq_len: int, cp: int) -> ActivationEstimate:
    """`activations` plus the one boolean mask every layer shares, kept from forward to backward."""
    mask = seq_len // cp * seq_len
    return ActivationEstimate(activations.kept + mask, activations.peak + mask)
