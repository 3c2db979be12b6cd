"""Activation memory of one device: what autograd keeps between forward and backward, and the peak
backward adds on top of it.

Counted per token from what the model code saves (bytes; a = bytes of the compute dtype, t = tp,
t_sp = t with sequence parallelism else 1, t_loss = t with loss parallelism else 1):

- Blocks: the family's own count (`ModelSpec.planning.block_activations`), written beside its model code with
  what it counts: the decoders' norms, attention and SwiGLU in titan_tpu/models/common/decoder_activations.py,
  Qwen 3 MoE's experts in titan_tpu/models/qwen3/activations.py, FLUX's blocks in titan_tpu/models/flux/activations.py.
- Head: the final norm (`norm_activations`), then the loss. The chunked cross-entropy keeps the
  logits and one float32 log-sum-exp per token (a V + 4); under loss parallelism the vocab-sharded
  logits go through F.cross_entropy, which keeps float32 log-probabilities of its shard
  ((a + 4) V / t_loss).

Activation checkpointing: a checkpointed block keeps only its input (a d / t_sp); `selective` N
checkpoints every Nth block; `selective` op keeps the block's matmul and attention outputs and its
input (`BlockActivations.selective_op`). Peak = the larger of: what is kept after
forward plus the loss's backward, or, for the block backward is at, what the blocks before it keep
plus all of that block's activations (recomputed if it was checkpointed) plus its backward's
gradients (of its widest intermediate and of its output and input, a d / t_sp each);
backward frees each block's activations as it leaves it. The chunked loss's backward holds the
logits' gradient (a V) and one float32 chunk of the softmax (at most 2^26 elements, whatever the
token count); F.cross_entropy's holds float32 gradients of log-probs and logits (8 V / t_loss).

Checked against a live-tensor count of a real forward + backward on the CPU
(tests/unit/plan/test_activations.py, every checkpointing mode within 10%).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.config.sections import ActivationCheckpointConfig
from titan_tpu.models.common.chunked_cross_entropy import chunk_tokens
from titan_tpu.models.common.decoder_activations import norm_activations
from titan_tpu.protocols.planning import FLOAT32, BlockActivations


@dataclass(frozen=True)
class Geometry:
    """What one device's forward pass sees."""

    micro_batch: int  # sequences (samples) per forward pass on one device
    tokens_per_sample: int  # sequence length; image + text tokens for FLUX
    act_bytes: int  # bytes per element of the compute dtype
    tp: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.tokens_per_sample

    @property
    def t_sp(self) -> int:
        return self.tp if self.sequence_parallel else 1

    @property
    def t_loss(self) -> int:
        return self.tp if self.loss_parallel else 1


@dataclass(frozen=True)
class ActivationEstimate:
    kept: int  # bytes held from the end of forward into backward
    peak: int  # kept plus backward's largest transient

    @property
    def transient(self) -> int:
        return self.peak - self.kept


def _loss_bytes(vocab_size: int, g: Geometry) -> tuple[float, float]:
    """Per token: what the loss keeps into backward, and what its backward adds on top."""
    if g.loss_parallel:
        vocab = vocab_size / g.t_loss
        return (g.act_bytes + FLOAT32) * vocab, 2 * FLOAT32 * vocab
    # One float32 chunk for the whole micro-batch, spread over its tokens like the rest.
    chunk = FLOAT32 * vocab_size * min(g.tokens, chunk_tokens(vocab_size)) / g.tokens
    return g.act_bytes * vocab_size + FLOAT32, g.act_bytes * vocab_size + chunk


def lm_head_bytes(vocab_size: int, dim: int, g: Geometry) -> tuple[float, float]:
    """Per token: what a language model's final norm and loss keep into backward, and what the
    loss's backward adds on top."""
    kept, transient = _loss_bytes(vocab_size, g)
    return kept + norm_activations(dim, g), transient


def estimate_activations(
    block: BlockActivations,
    n_blocks: int,
    g: Geometry,
    ac: ActivationCheckpointConfig,
    head: tuple[float, float] = (0.0, 0.0),
) -> ActivationEstimate:
    """Activation bytes of one device for one micro-batch of `n_blocks` blocks under the
    checkpointing mode `ac`; `head` is what the head keeps and its backward adds, per token
    (`lm_head_bytes`; a velocity head, d -> in_channels, is negligible)."""
    head_kept, head_transient = head
    whole = [ac.wraps_block(index) and not ac.op_level for index in range(n_blocks)]
    kept_by_block = [
        block.checkpointed if wrapped else block.selective_op if ac.op_level else block.full for wrapped in whole
    ]
    in_flight = 0.0
    if ac.offload:
        # Each checkpointed block's input (part of what it keeps) waits in host memory; the device
        # holds one in flight: being copied out in forward, or back for its block in backward.
        kept_by_block = [
            kept - (block.checkpointed if ac.wraps_block(index) else 0.0) for index, kept in enumerate(kept_by_block)
        ]
        in_flight = block.checkpointed
    kept = sum(kept_by_block) + head_kept + in_flight
    # Backward frees each block's activations once it is done, last block first. While block i runs
    # backward the blocks before it still hold theirs; block i holds all of its own (recomputed, if
    # checkpointed, beside the input it kept) and its backward's gradients.
    while_blocks = max(
        sum(kept_by_block[:index]) + block.full + block.backward + (block.checkpointed if wrapped else 0.0) + in_flight
        for index, wrapped in enumerate(whole)
    )
    peak = max(kept + head_transient, while_blocks)
    return ActivationEstimate(int(kept * g.tokens), int(peak * g.tokens))
