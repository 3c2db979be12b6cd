"""Held-out loss of a causal language model: the `[validation]` section's numbers, for any task whose
batches are token rows with shifted labels (language-model pretraining, fine-tuning).

As TorchTitan's Validator does, a fixed number of held-out rows is evaluated each time, from the
start of its own source: `validation.batches` global batches of `training.global_batch_size` rows.
Rank r of W evaluates rows r, r+W, r+2W, ... in micro-batches of `local_batch_size`, so every rank
runs `batches x grad_accum_steps` forward passes (FSDP's and the router's collectives need every
rank to run as many) and the ranks together evaluate the same rows whatever the layout. The loss is
the sum of per-token cross-entropy over all counted labels of all ranks divided by their count, not
a mean of per-batch means: a batch with more counted tokens (fine-tuning masks prompts) weighs more,
and the number does not depend on how the rows are split into micro-batches.

The loss is the plain cross-entropy: a mixture-of-experts model's router auxiliary loss is a
training regulariser, not part of how well the model predicts held-out text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_tpu.config import ConfigError
from titan_tpu.distributed.fsdp import reshard_all
from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.distributed.tensor_parallel import local_value, loss_context
from titan_tpu.generation.logprobs import logits_of
from titan_tpu.models.common.chunked_cross_entropy import CHUNK_ELEMENTS, chunk_tokens
from titan_tpu.models.common.loss import IGNORE_INDEX
from titan_tpu.tasks.base import TaskContext

_LARGEST_EXP = math.log(torch.finfo(torch.float64).max)


def micro_batches_per_evaluation(ctx: TaskContext) -> int:
    """How many micro-batches of `ctx.local_batch_size` rows each rank evaluates: its share of
    `validation.batches` global batches, i.e. `batches` optimizer steps' worth of micro-batches."""
    return ctx.config.validation.batches * ctx.grad_accum_steps


def held_out_rows(ctx: TaskContext) -> int:
    """Rows one evaluation reads, over all ranks together."""
    return ctx.config.validation.batches * ctx.config.training.global_batch_size


def require_held_out_rows(ctx: TaskContext, description: str, found: int, row: str) -> None:
    """Refuse a held-out source with fewer rows than one evaluation reads: repeating rows would
    weigh them twice, and the number would not be the loss of that many distinct rows."""
    config = ctx.config
    needed = held_out_rows(ctx)
    if found < needed:
        raise ConfigError(
            f"validation.batches: {description} holds {found} rows ({row}), fewer than validation.batches x "
            f"training.global_batch_size = {config.validation.batches} x {config.training.global_batch_size} = "
            f"{needed}; lower validation.batches or give more held-out data"
        )


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Sum over labels != IGNORE_INDEX of -log softmax(logits)[label], in float32.

    logits [B, S, V], labels [B, S]. Plain logits are upcast one chunk of tokens at a time (at most
    `chunk_elements` float32 values, as the training loss does), so no float32 copy of the whole
    logits exists. Vocab-sharded DTensor logits (loss parallel) go whole to `F.cross_entropy`, which
    `loss_parallel()` computes without gathering the vocabulary; the result is its full value."""
    logits, labels = logits.flatten(0, 1), labels.flatten(0, 1)
    if isinstance(logits, DTensor):
        total = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return local_value(total)
    step = chunk_tokens(logits.shape[-1], chunk_elements)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], step):
        chunk = logits[start : start + step].float()
        total += F.cross_entropy(chunk, labels[start : start + step], ignore_index=IGNORE_INDEX, reduction="sum")
    return total


@torch.no_grad()
def held_out_loss(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    ctx: TaskContext,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> dict[str, float]:
    """`validation/loss` (summed cross-entropy / counted tokens over all data-parallel ranks),
    `validation/perplexity` (its exp) and `validation/tokens` (the count) of `batches`.

    Each batch: `input_ids` [B, S] and `labels` [B, S] (long, IGNORE_INDEX = not counted), and
    optionally `document_ids` [B, S], handed to the model as `model(input_ids, document_ids=...)`.
    Every rank must call it, with as many batches as the others (see the module doc). The model is
    put in eval mode for the passes and given back in the mode it was in, with every FSDP group
    sharded again."""
    device = ctx.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            document_ids = batch.get("document_ids")
            if document_ids is None:
                output = model(input_ids)
            else:
                output = model(input_ids, document_ids=document_ids.to(device, non_blocking=True))
            # With loss parallel the logits are vocab-sharded, as in the trainer's loss.
            with loss_context(ctx.parallel.loss_parallel_enabled):
                total += cross_entropy_sum(logits_of(output), labels, chunk_elements)
            count += (labels != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
        reshard_all(model)
    mesh = ctx.parallel.dp_reduce_mesh
    tokens = int(sum_over(count, mesh))
    if tokens == 0:
        raise ConfigError(
            "validation: the held-out rows count no token (every label is ignored); give held-out data with targets"
        )
    loss = float(sum_over(total, mesh)) / tokens
    # math.exp raises past ~709; a diverged model's perplexity is reported as inf instead.
    perplexity = math.exp(loss) if loss < _LARGEST_EXP else math.inf
    return {"validation/loss": loss, "validation/perplexity": perplexity, "validation/tokens": float(tokens)}
