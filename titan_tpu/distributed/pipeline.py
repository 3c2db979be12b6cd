"""Pipeline parallelism (`parallelism.pp`): the model split into stages on `meta`, and the
micro-batch schedule of torch.distributed.pipelining that trains them.

A stage is the whole decoder with the other stages' modules removed (layers deleted from the
ModuleDict, embedding or norm and head set to None; titan_tpu/models/common/decoder.py runs what is left), so
every parameter keeps its name: checkpoints, saved by name, load under any pp degree, and the
layout-invariant init (sharded_init.py) gives each parameter the values one process gives it. Each
stage then goes through the same fixed order as a whole model (TP -> AC -> compile -> FSDP ->
materialise), on the meshes of its own pp coordinate.

The loss: the schedule computes it on the last stage per micro-batch. Each micro-batch's mean loss
is weighted by its share of the local batch's counted tokens (labels != -100) and the gradients are
not rescaled by the schedule, so the micro-batch losses add up to the local batch's mean token
loss, as one forward pass over the batch computes it. Other stages report 0, which the trainer's
sum over (pp, dp) leaves out.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from titan_tpu.config import TrainConfig
from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.distributed.pipeline_plan import MULTI_STAGE_SCHEDULES, PipelinePlan, plan_pipeline

IGNORE_INDEX = -100
# parallelism.pp_schedule -> torch's schedule (the public ones of torch.distributed.pipelining).
SCHEDULES = {
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
}


def stage_models(meta_model: nn.Module, plan: PipelinePlan, pp_rank: int, what: str) -> list[tuple[int, nn.Module]]:
    """(stage index, stage model on meta) for every stage pp rank `pp_rank` runs, each a copy of
    `meta_model` cut down by its `keep_pipeline_stage`."""
    stages = []
    for index in plan.stages_of_rank(pp_rank):
        stage = copy.deepcopy(meta_model)
        first, last = index == 0, index == plan.n_stages - 1
        layers = plan.stage_layers[index]
        try:
            stage.keep_pipeline_stage(layers, first, last)  # type: ignore[operator]  # a method of the family's model
        except ValueError as error:
            raise ConfigError(f"parallelism.pp: {what}: {error}; set parallelism.pp = 1") from None
        stages.append((index, stage))
    return stages


class StageUnion(nn.Module):
    """The stages one rank runs (an interleaved schedule's two or more) as one module whose
    parameters carry the names one process gives them: the stages' `layers` merged into one
    ModuleDict, their other modules (embedding, norm, head, rotary tables) taken as they are. It
    shares every module with the stages, so the optimizer and checkpoints see the stages' own
    parameters. The schedule runs the stages; this module has no forward of its own."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                if isinstance(child, nn.ModuleDict):
                    merged = self._modules.setdefault(name, nn.ModuleDict())
                    if not isinstance(merged, nn.ModuleDict):
                        raise TypeError(f"pipeline stages disagree on {name!r}: a ModuleDict in one, not in another")
                    merged.update(dict(child.items()))  # the stub takes a Mapping, which a ModuleDict is not
                elif name not in self._modules:
                    self._modules[name] = child


class PipelineRunner:
    """One optimizer step's forward and backward of this rank's stages over the micro-batches."""

    def __init__(
        self,
        parts: list[tuple[int, nn.Module]],
        plan: PipelinePlan,
        ctx: ParallelContext,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        group = ctx.pp_mesh.get_group()
        self.modules = [module for _, module in parts]
        self.stages = [PipelineStage(module, index, plan.n_stages, device, group=group) for index, module in parts]
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        self.device = device
        self._counted_tokens = torch.ones((), device=device)
        schedule_cls = SCHEDULES[plan.schedule]
        stages = self.stages if plan.schedule in MULTI_STAGE_SCHEDULES else self.stages[0]

        def weighted_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            share = (labels != IGNORE_INDEX).sum() / self._counted_tokens
            return loss_fn(output, labels) * share

        self.schedule = schedule_cls(stages, n_microbatches=plan.microbatches, loss_fn=weighted_loss, scale_grads=False)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of (input_ids, labels) [B, S]; returns the
        batch's mean token loss on the rank holding the last stage, 0 elsewhere (device tensors)."""
        self._counted_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
        losses: list[torch.Tensor] = []
        target = labels if self.has_last else None
        if self.has_first:
            self.schedule.step(input_ids, target=target, losses=losses, return_outputs=False)
        else:
            self.schedule.step(target=target, losses=losses, return_outputs=False)
        if not self.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach() for loss in losses]).sum()


def build_pipeline(
    meta_model: nn.Module,
    spec: Any,
    ctx: ParallelContext,
    config: TrainConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
    local_batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[nn.Module, PipelineRunner]:
    """This rank's stages of `meta_model` (built from the ModelSpec `spec`), each parallelised and
    materialised in the fixed order, and the runner of their schedule. The module returned (what the
    optimizer steps and checkpoints save) is the one stage, or with several stages per rank their
    StageUnion."""
    what = f"model {config.model.name} flavor {config.model.flavor}"
    if not spec.capabilities.pipeline_stages:
        raise ConfigError(
            f"parallelism.pp: {what} cannot be cut into pipeline stages (llama3, qwen3 and qwen3_moe can); "
            "set parallelism.pp = 1"
        )
    n_layers = len(meta_model.layers)  # type: ignore[arg-type]  # a pipeline_stages model's ModuleDict
    plan = plan_pipeline(config.parallelism, n_layers, local_batch_size)
    parts = [
        (index, parallelize_model(stage, spec.parallelize, ctx, config, device, compute_dtype))
        for index, stage in stage_models(meta_model, plan, ctx.pp_mesh.get_local_rank(), what)
    ]
    runner = PipelineRunner(parts, plan, ctx, device, loss_fn)
    modules = runner.modules
    return (modules[0] if len(modules) == 1 else StageUnion(modules)), runner
