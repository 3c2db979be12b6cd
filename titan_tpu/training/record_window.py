"""The training loop's records: on which steps one is written (and the task evaluates), the window of
steps since the last one, and how the window's losses come back from the device.

The loop keeps each step's loss on the device and reads the window's losses in one go on a record
step (or before a checkpoint): one reduction over the ranks that share a loss and one device-to-host
copy, so the accelerator is never stalled by the host in between.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from titan_tpu.config import TrainConfig
from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.distributed.parallel_dims import ParallelContext


@dataclasses.dataclass
class RecordWindow:
    """What the steps since the last record left on the device, read back in one go."""

    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    items: int = 0
    steps: int = 0
    start: float = 0.0

    def add(self, loss: torch.Tensor, items: int) -> None:
        """One step's loss (this rank's, a device tensor) and the items it trained on."""
        self.losses.append(loss)
        self.items += items
        self.steps += 1

    def reset(self) -> None:
        self.losses, self.items, self.steps, self.start = [], 0, 0, time.perf_counter()


def is_eval_step(step: int, config: TrainConfig) -> bool:
    eval_freq = config.metrics.eval_freq
    if step == config.training.steps:
        # eval_freq = 0 turns periodic evaluation off, but a run that enabled [validation] asked
        # for a held-out loss, and gets at least the final one.
        return eval_freq > 0 or config.validation.enable
    return eval_freq > 0 and step % eval_freq == 0


def is_record_step(step: int, config: TrainConfig) -> bool:
    return (
        step == 1 or step % config.metrics.log_freq == 0 or step == config.training.steps or is_eval_step(step, config)
    )


def mean_over_data_parallel(losses: list[torch.Tensor], parallel: ParallelContext) -> list[float]:
    """Each of `losses` (this rank's, device tensors) averaged over the data-parallel ranks, and the
    context-parallel ones with cp > 1. With pp > 1 the sum runs over every stage (the last holds the
    loss, the others add zeros), so every rank, the first stage's included, gets the mean. A
    collective: every rank of the run calls it, with as many losses."""
    mesh, ranks = parallel.loss_reduce_mesh, parallel.loss_reduce_ranks
    return (sum_over(torch.stack(losses).float(), mesh) / ranks).tolist()
