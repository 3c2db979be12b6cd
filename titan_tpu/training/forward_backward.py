"""One optimizer step's forward and backward, the two ways the trainer takes it.

Without pipeline parallelism the step is `grad_accum_steps` micro-batches of the task's loss, each
backward-ed at once (gradient accumulation). With `parallelism.pp` > 1 the step is one batch handed
to the pipeline schedule (titan_tpu/distributed/pipeline.py), which cuts it into its own
micro-batches and runs forward and backward through this rank's stages. Both return the step's
mean loss on this rank (a device tensor, read later by the trainer) and the items trained on.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_tpu.distributed.pipeline import PipelineRunner
from titan_tpu.distributed.tensor_parallel import local_value, loss_context
from titan_tpu.tasks.base import TrainingTask


def accumulated_forward_backward(
    model: nn.Module, task: TrainingTask, grad_accum_steps: int, loss_parallel: bool, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Loss and gradients over `grad_accum_steps` micro-batches: the mean micro-batch loss (this
    rank's) and the items this rank trained on."""
    loss_sum = torch.zeros((), device=device)
    items = 0
    for _ in range(grad_accum_steps):
        # Every forward of the model runs in the run's one precision: a task's batch may come from
        # the model (GRPO's sampling and rollout log-probabilities), and must match its loss.
        with task.ctx.autocast():
            batch = task.next_batch(model)
        # With loss parallel the logits are vocab-sharded: loss and backward run in its context.
        with loss_context(loss_parallel):
            with task.ctx.autocast():
                result = task.loss(model, batch)
            # Every micro-batch weighs the same, so the mean of the means is the step's mean.
            loss = result.loss / grad_accum_steps
            loss.backward()
        loss_sum += local_value(loss.detach())
        items += result.items
    return loss_sum, items


def pipeline_forward_backward(
    model: nn.Module, pipeline: PipelineRunner, task: TrainingTask
) -> tuple[torch.Tensor, int]:
    """The schedule's micro-batches of one batch through this rank's stages (`model`): the batch's
    mean loss on the last stage's ranks (0 on the others) and the items of the batch."""
    with task.ctx.autocast():
        batch = task.next_batch(model)
        input_ids, labels, items = task.pipeline_inputs(batch)
        return pipeline.step(input_ids, labels), items
