"""What every task that trains a decoder language model on token rows shares (pretraining, SFT,
GRPO): the model arguments fitted to the run, and the workload the planner counts for it."""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.tokenizer import Tokenizer
from titan_tpu.models.common.attention_kernels import requested_attention
from titan_tpu.protocols.model_spec import LossFn, ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.base import TaskContext


def language_model_loss(ctx: TaskContext) -> LossFn:
    """The family's next-token loss; a family without one (FLUX) is refused for a decoder task."""
    if ctx.spec.loss_fn is None:
        raise ConfigError(
            f"training.task: model {ctx.spec.name} has no language-model loss; its task is "
            f"'{ctx.spec.default_task}' (set training.task = 'auto')"
        )
    return ctx.spec.loss_fn


def decoder_args(ctx: TaskContext, tokenizer: Tokenizer, args: Any) -> Any:
    """A decoder flavor's arguments for this run: rotary tables sized for training.seq_len (published
    flavors allow 128K) and the attention kernel `model.attention_block` asks for ("auto" is measured
    later, at the run's shapes); the tokenizer must fit the vocabulary."""
    model = ctx.config.model
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model {model.name} "
            f"{model.flavor} has vocab_size {args.vocab_size}; pick a tokenizer or flavor that fits"
        )
    attention = requested_attention(model.attention_block)
    return dataclasses.replace(args, max_seq_len=ctx.config.training.seq_len, attention=attention)


def decoder_workload(config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
    """Tokens of training.seq_len per sample, FLOPs per token from the family's own function (the one
    the trainer's MFU uses), plus what a mixture of experts makes every tp rank repeat."""
    seq_len = config.training.seq_len
    flops = spec.flops_per_token(args, seq_len)
    # The output head (6 V d per token) runs once; only the blocks are recomputed.
    head = 6.0 * args.vocab_size * args.dim
    routing = spec.planning.expert_routing
    moe = routing(args).training_flops_per_token if routing is not None else 0.0
    return Workload("tokens", seq_len, seq_len, flops, (flops - head) / 3, moe)


def require_decoding(ctx: TaskContext, args: Any, key: str, remedy: str) -> None:
    """A ConfigError naming `key` and what to do instead (`remedy`) unless the family's models of
    `args` decode with a KV cache (the builtin sampler's way)."""
    decoding = ctx.spec.capabilities.decoding
    reason = "it has no KV-cache decoding" if decoding is None else decoding.unsupported(args)
    if reason is not None:
        raise ConfigError(f"{key}: model {ctx.spec.name} cannot be sampled by the builtin sampler ({reason}); {remedy}")
