"""Language-model pretraining: packed token sequences in, next-token cross-entropy out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config import ConfigError
from titan_tpu.data.loader import build_dataloader
from titan_tpu.data.tokenizer import Tokenizer, build_tokenizer
from titan_tpu.distributed.compile import compile_loss, resolve_backend
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask


def decoder_args(ctx: TaskContext, tokenizer: Tokenizer, args: Any) -> Any:
    """A decoder flavor's arguments for this run: rotary tables sized for training.seq_len (published
    flavors allow 128K) and the attention kernel chosen for the device; the tokenizer must fit the
    vocabulary. Every task that trains a decoder (pretraining, GRPO) builds its model this way."""
    model = ctx.config.model
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but model {model.name} "
            f"{model.flavor} has vocab_size {args.vocab_size}; pick a tokenizer or flavor that fits"
        )
    return dataclasses.replace(args, max_seq_len=ctx.config.training.seq_len, attention=ctx.attention)


def documents_after_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] document ids of packed rows: the packer ends every document with eos, so a document
    begins after each eos (an eos belongs to the document it ends)."""
    ends = (input_ids == eos_id).long()
    return ends.cumsum(dim=1) - ends


class LanguageModelTask(TrainingTask):
    """Batches `{"input_ids", "labels"}` of `seq_len` tokens from the configured corpus; the loss is
    the model family's own (`ModelSpec.loss_fn`: cross-entropy, plus the router's auxiliary loss for
    mixture-of-experts models)."""

    unit = "tokens"
    chunked_loss = True

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        self.seq_len = config.training.seq_len
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        self.loss_fn = ctx.spec.loss_fn
        # Vocab-sharded logits (loss parallel) need the DTensor loss, which compile does not trace.
        if config.compile.enable and not ctx.parallel.loss_parallel_enabled:
            self.loss_fn = compile_loss(self.loss_fn, resolve_backend(config.compile.backend, ctx.device.type))
        self.args: Any = None
        self.dataloader: StatefulDataLoader | None = None
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None

    def model_args(self, args: Any) -> Any:
        self.args = decoder_args(self.ctx, self.tokenizer, args)
        return self.args

    def setup(self, model: nn.Module) -> None:
        ctx = self.ctx
        # The loss's chunk, as the run chose it (titan_tpu/kernels/ replaced "auto" in model.args).
        self.loss_chunk_elements: int = model.args.loss_chunk_elements
        self.dataloader = build_dataloader(
            ctx.config.data,
            self.tokenizer,
            seq_len=self.seq_len,
            local_batch_size=ctx.local_batch_size,
            dp_rank=ctx.dp_rank,
            dp_world_size=ctx.dp_world,
            seed=ctx.config.training.seed,
        )

    def data_state(self) -> StatefulDataLoader | None:
        return self.dataloader

    def next_batch(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self._batches is None:
            assert self.dataloader is not None, "setup() builds the data loader"
            # Created on first use, after a checkpoint may have restored the loader's position.
            self._batches = iter(self.dataloader)
        return next(self._batches)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> TaskLoss:
        device = self.ctx.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        if self.ctx.config.data.document_mask:
            output = model(input_ids, document_ids=documents_after_eos(input_ids, self.tokenizer.eos_id))
        else:
            output = model(input_ids)
        return TaskLoss(self.loss_fn(output, labels, self.loss_chunk_elements), items=labels.numel())

    def flops_per_item(self) -> float:
        return self.ctx.spec.flops_per_token(self.args, self.seq_len)
