"""Activation memory of one device: what autograd keeps between forward and backward, and the peak
backward adds on top of it.

Counted per token from what the model code saves (bytes; a = bytes of the compute dtype, t = tp,
t_sp = t with sequence parallelism else 1, t_loss = t with loss parallelism else 1):

- Decoder block, no recomputation: each of the two RMSNorms keeps its float32 input and its normed
  output ((4 + a) d / t_sp: they run on the sequence shard) and hands its projections a full-sequence
  input (a d, all-gathered under sequence parallelism); attention keeps q, the grouped-query k and v
  repeated to every head, and its output (4 H D a / t: the fused kernels keep no S x S matrix); the
  SwiGLU keeps w1 x, silu(w1 x), w3 x and their product (4 F a / t). Qwen 3's per-head q/k norms add
  their float32 input and output ((4 + a)(H + H_kv) D / t).
- Mixture-of-experts feed-forward (Qwen 3 MoE, replicated over tp, full sequence): router logits and
  float32 probabilities ((a + 4) E), each token's k routed copies going in and out of the experts
  (3 k d a) and the experts' SwiGLU on them (4 k F_moe a); capacity padding is not counted.
- FLUX block (double or single stream, over the joint image + text sequence): two float32 LayerNorm
  inputs and modulated outputs (2 (4 + a) d), q, k, v, the attention output and projection input
  (5 d a) and the MLP's input, GELU and output (3 F a). Not measured; an estimate of the same kind.
- Head: the final norm as above, then the loss. The chunked cross-entropy keeps the logits and one
  float32 log-sum-exp per token (a V + 4); under loss parallelism the vocab-sharded logits go through
  F.cross_entropy, which keeps float32 log-probabilities of its shard ((a + 4) V / t_loss).

Activation checkpointing: a checkpointed block keeps only its input (a d / t_sp); `selective` N
checkpoints every Nth block; `selective` op keeps the matmul and attention outputs
((Q + 2 KV) + H D) a / t + 2 a d + 2 F a / t) and the input. Peak = the larger of: what is kept after
forward plus the loss's backward, or, for the block backward is at, what the blocks before it keep
plus all of that block's activations (recomputed if it was checkpointed) plus its backward's
gradients (of its widest intermediate, F a / t, and of its output and input, a d / t_sp each);
backward frees each block's activations as it leaves it. The chunked loss's backward holds the
logits' gradient (a V) and one float32 chunk of the softmax (at most 2^26 elements, whatever the
token count); F.cross_entropy's holds float32 gradients of log-probs and logits (8 V / t_loss).

Checked against a live-tensor count of a real forward + backward on the CPU
(tests/unit/test_plan_activations.py, every checkpointing mode within 10%).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.common.chunked_cross_entropy import chunk_tokens
from models.flux.args import FluxArgs
from models.qwen3.args import Qwen3Args, Qwen3MoeArgs
from titan_tpu.config.sections import ActivationCheckpointConfig

FLOAT32 = 4


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


@dataclass(frozen=True)
class _BlockBytes:
    """Per token, bytes."""

    full: float  # everything a non-checkpointed block keeps
    selective_op: float  # kept under op-level selective checkpointing
    checkpointed: float  # a checkpointed block's input
    # What the block's backward holds beyond its activations: the gradients of its widest intermediate,
    # of its output (arriving) and of its input (leaving).
    backward: float


def _norm(dim: int, g: Geometry) -> float:
    return (FLOAT32 + g.act_bytes) * dim / g.t_sp + g.act_bytes * dim


def _decoder_block(args: Any, g: Geometry) -> _BlockBytes:
    a, t, d = g.act_bytes, g.tp, args.dim
    q_width = args.n_heads * args.attn_head_dim
    kv_width = args.n_kv_heads * args.attn_head_dim
    attention = 4 * q_width * a / t
    if isinstance(args, Qwen3Args):  # per-head q/k norms
        attention += (FLOAT32 + a) * (q_width + kv_width) / t
    projections = (q_width + 2 * kv_width + q_width) * a / t + 2 * a * d
    if isinstance(args, Qwen3MoeArgs):
        k, experts = args.top_k, args.num_experts
        ffn = (a + FLOAT32) * experts + 3 * k * d * a + 4 * k * args.moe_hidden_dim * a
        widest = k * args.moe_hidden_dim * a
        matmuls = (experts + 2 * k * args.moe_hidden_dim + k * d) * a
    else:
        ffn = 4 * args.ffn_hidden_dim * a / t
        widest = args.ffn_hidden_dim * a / t
        matmuls = 2 * args.ffn_hidden_dim * a / t
    full = 2 * _norm(d, g) + attention + ffn
    checkpointed = a * d / g.t_sp
    backward = widest + 2 * checkpointed  # the residual stream's gradients are the input's shape
    return _BlockBytes(full, projections + matmuls + checkpointed, checkpointed, backward)


def _flux_block(args: FluxArgs, g: Geometry) -> _BlockBytes:
    a, d, hidden = g.act_bytes, args.dim, args.mlp_hidden_dim
    full = 2 * (FLOAT32 + a) * d + 5 * d * a + 3 * hidden * a
    matmuls = 5 * d * a + hidden * a + d * a
    return _BlockBytes(full, matmuls, d * a, hidden * a + 2 * d * a)


def _loss_bytes(vocab_size: int, g: Geometry) -> tuple[float, float]:
    """Per token: what the loss keeps into backward, and what its backward adds on top."""
    if g.loss_parallel:
        vocab = vocab_size / g.t_loss
        return (g.act_bytes + FLOAT32) * vocab, 2 * FLOAT32 * vocab
    # One float32 chunk for the whole micro-batch, spread over its tokens like the rest.
    chunk = FLOAT32 * vocab_size * min(g.tokens, chunk_tokens(vocab_size)) / g.tokens
    return g.act_bytes * vocab_size + FLOAT32, g.act_bytes * vocab_size + chunk


def estimate_activations(args: Any, n_blocks: int, g: Geometry, ac: ActivationCheckpointConfig) -> ActivationEstimate:
    """Activation bytes of one device for one micro-batch under the checkpointing mode `ac`."""
    if isinstance(args, FluxArgs):
        block = _flux_block(args, g)
        head_kept, head_transient = 0.0, 0.0  # the velocity head is d -> in_channels: negligible
    else:
        block = _decoder_block(args, g)
        head_kept, head_transient = _loss_bytes(args.vocab_size, g)
        head_kept += _norm(args.dim, g)
    whole = [ac.wraps_block(index) and not ac.op_level for index in range(n_blocks)]
    kept_by_block = [block.checkpointed if wrapped else block.selective_op if ac.op_level else block.full
                     for wrapped in whole]  # fmt: skip
    kept = sum(kept_by_block) + head_kept
    # Backward frees each block's activations once it is done, last block first. While block i runs
    # backward the blocks before it still hold theirs; block i holds all of its own (recomputed, if
    # checkpointed, beside the input it kept) and its backward's gradients.
    while_blocks = max(
        sum(kept_by_block[:index]) + block.full + block.backward + (block.checkpointed if wrapped else 0.0)
        for index, wrapped in enumerate(whole)
    )
    peak = max(kept + head_transient, while_blocks)
    return ActivationEstimate(int(kept * g.tokens), int(peak * g.tokens))
