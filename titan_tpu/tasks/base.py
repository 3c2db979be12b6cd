"""The seam between the one trainer and what it trains.

The trainer owns what every kind of training shares: the model built on `meta` and parallelised,
micro-batches with gradient accumulation, mixed precision, clipping, the optimizer and schedule,
checkpoints and the metrics record. A `TrainingTask` supplies what differs:

- `model_args(args)`: fit the flavor's arguments to the run (sequence length, attention kernel);
  called before the model is built.
- `setup(model)`: build the data pipeline (and anything that needs the built model, such as GRPO's
  frozen reference policy); called once the model is materialised.
- `data_state()`: the Stateful object holding the data position, saved in every checkpoint.
- `next_batch(model)`: one micro-batch for this process. It gets the current model because some
  tasks make their batch with it (GRPO samples completions from the policy).
- `loss(model, batch)`: forward pass and loss of one micro-batch, with the count of items (tokens,
  images) it trained on; the trainer calls backward. `next_batch`, `loss` and `evaluate` run under
  `TaskContext.autocast`, the run's one precision.
- `flops_per_item()` and `unit`: model FLOPs (forward + backward) per item for MFU, and the name of
  an item in the throughput field (`tokens_per_sec`, `samples_per_sec`).
- `step_metrics()`: extra values for the step record (read on logging steps only).
- `evaluate(model, step)`: held-out numbers or samples every `metrics.eval_freq` steps.
- `describe_data()` and `console_view(loss, extras)`: the data in the run's start-up line, and which
  of the task's values its step lines show (metrics.jsonl keeps them all).

Language-model pretraining is one task (`language_model.py`); rectified-flow image training and
GRPO are others. Tasks are found by name in `registry.py`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_tpu.config.errors import ConfigError
from titan_tpu.metrics.console import ConsoleView

if TYPE_CHECKING:
    from titan_tpu.config import TrainConfig
    from titan_tpu.distributed.parallel_dims import ParallelContext
    from titan_tpu.protocols.model_spec import ModelSpec
    from titan_tpu.protocols.planning import Workload


@dataclass(frozen=True)
class TaskContext:
    """What a task may know about the run: the config, the model family, where this process sits."""

    config: TrainConfig  # as loaded, read only: what the run resolved (the dtype) is in the fields below
    spec: ModelSpec
    device: torch.device
    compute_dtype: torch.dtype
    parallel: ParallelContext
    dp_rank: int
    dp_world: int
    local_batch_size: int  # samples per micro-batch on this process
    grad_accum_steps: int
    dump_folder: Path
    is_writer: bool

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision of every forward pass of the run: autocast to the compute dtype, except in
        float32 and under FSDP, whose mixed-precision policy already casts the parameters. The trainer
        runs a task's `next_batch`, `loss` and `evaluate` under it, so a batch made with the model
        (GRPO's sampling and rollout log-probabilities) comes from the same policy as the loss: the
        first ratio is then exactly 1."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    @property
    def uses_autocast(self) -> bool:
        """Whether `autocast()` casts: not in float32, and not under FSDP's mixed precision."""
        return self.compute_dtype != torch.float32 and not self.parallel.dims.fsdp_enabled


@dataclass
class TaskLoss:
    """The loss of one micro-batch (a scalar tensor, mean over its items) and how many items it
    covered on this process (tokens, images), for throughput."""

    loss: torch.Tensor
    items: int


class TrainingTask(ABC):
    """Base class: the optional parts have neutral defaults; the abstract ones must be implemented."""

    unit: str = "items"
    # The loss is the model family's chunked cross-entropy (`ModelSpec.loss_fn`), whose chunk the run
    # measures; other tasks' losses leave it at its default and the measurement is skipped.
    chunked_loss: bool = False
    # Whether the task splits each sample's sequence over the cp ranks (parallelism.cp > 1);
    # a task that does not is refused rather than run with every cp rank training whole rows.
    context_parallel: bool = False
    # Whether the task can be trained through pipeline stages (parallelism.pp > 1): it then has
    # `pipeline_inputs(batch)` -> (first stage's input, labels, items) and `pipeline_loss(output,
    # labels)`, the mean loss of the last stage's output.
    pipeline_parallel: bool = False

    def __init__(self, ctx: TaskContext) -> None:
        self.ctx = ctx
        pp = ctx.parallel.dims.pp
        if pp > 1 and not self.pipeline_parallel:
            raise ConfigError(
                f"parallelism.pp = {pp}: the {type(self).__name__} cannot be trained through pipeline stages "
                "(language-model pretraining can); set parallelism.pp = 1"
            )
        cp = ctx.parallel.dims.cp
        if cp > 1 and not self.context_parallel:
            raise ConfigError(
                f"parallelism.cp = {cp}: the {type(self).__name__} does not split sequences over cp ranks "
                "(language-model pretraining does); set parallelism.cp = 1"
            )

    def model_args(self, args: Any) -> Any:
        return args

    @abstractmethod
    def setup(self, model: nn.Module) -> None: ...

    def data_state(self) -> Any | None:
        return None

    @abstractmethod
    def next_batch(self, model: nn.Module) -> Any: ...

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> TaskLoss: ...

    @abstractmethod
    def flops_per_item(self) -> float: ...

    # Implemented by a task with `pipeline_parallel`; a task without it is refused under pp > 1 above.
    def pipeline_inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the first stage's input, the labels, the batch's items)."""
        raise NotImplementedError(f"{type(self).__name__} is not trained through pipeline stages")

    def pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of the last stage's output."""
        raise NotImplementedError(f"{type(self).__name__} is not trained through pipeline stages")

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        """What one training step computes, for the planner (`python -m titan_tpu.plan`): from the
        config and the model's arguments alone, without building the task or its data."""
        raise ConfigError(f"the planner has no workload for {cls.__name__}: it does not define planned_workload")

    def step_metrics(self) -> dict[str, float]:
        return {}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        return {}

    def describe_data(self) -> str:
        """What the run trains on and how much of it, in a few words, for the start-up line (called once
        on the writing process, after `setup`). A task that knows its data's size says it here."""
        return f"{type(self).__name__}'s batches, {self.ctx.config.training.global_batch_size} samples a step"

    def console_view(self, loss: float, extras: Mapping[str, float]) -> ConsoleView:
        """Which of a record's values (`extras`: `step_metrics` and `evaluate`'s) its console line shows,
        and a note under it; every value by default."""
        return ConsoleView()

    def close(self) -> None:  # noqa: B027 (a hook with nothing to do by default, not an abstract method)
        """Release what the task started (a rollout engine's server); called once the run ends."""
