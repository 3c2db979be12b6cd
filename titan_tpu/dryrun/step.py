"""One training step of a simulated rank on fake tensors, every collective recorded.

The model was set up on `meta` (titan_tpu/dryrun/trainer.py); here it is materialised as fake
tensors (torch's FakeTensorMode: shapes, dtypes and devices, no data), and the trainer's own
forward and backward and optimizer step run on it: one micro-batch, gradient clipping, the
optimizer step (which creates AdamW's state, as fake tensors too). The step's batch is drawn from the
task's data first, for real: it is a few token ids, and a data loader cannot run on fake tensors.
Then the checkpoint's state dicts are read, as a save would read them.

One micro-batch, not the step's `grad_accum` of them: with gradient accumulation each micro-batch
repeats the same forward, backward and FSDP collectives (titan_tpu/plan/roofline.py counts them so).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titan_tpu.dryrun.collectives import Collective, group_axes
from titan_tpu.dryrun.fake_mode import SimulatedTensors
from titan_tpu.dryrun.trainer import DryRunTrainer


@dataclass(frozen=True)
class StepTrace:
    collectives: list[Collective]
    seconds: float
    # What a checkpoint holds: key -> global shape, for the model's and the optimizer's state.
    model_state: dict[str, tuple[int, ...]]
    optimizer_state: dict[str, tuple[int, ...]]
    # Bytes of this rank's tensors after the step, by kind: parameters, gradients, optimizer state.
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    # The most bytes the step's own tensors held at once (activations, gathered parameters, gradients,
    # the optimizer state as it is created), wherever they sit; the parameters from before it are not in it.
    step_peak_bytes: int
    micro_batches_per_step: int  # the step's gradient accumulation, of which one micro-batch ran
    stepped: bool  # False: set up only (a pipeline, PIPELINE_NOT_STEPPED)
    routed: bool  # a mixture-of-experts layer was routed by the stand-in (titan_tpu/dryrun/routing.py)


# Why a pipeline is set up but not stepped.
PIPELINE_NOT_STEPPED = (
    "pipeline: set up, not stepped: torch's schedule starts with a vote between the stages (its P2P "
    "warm-up reads the value it received), which the fake process group cannot carry; no "
    "collectives or gradients are reported (the optimizer state is what reading its state dict creates)"
)


def _global_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def simulate_step(trainer: DryRunTrainer) -> StepTrace:
    start = time.perf_counter()
    modules = trainer.pipeline.modules if trainer.pipeline is not None else [trainer.model]
    batch = trainer.task.next_batch(modules[0])
    trainer.task.next_batch = lambda model: batch  # type: ignore[method-assign]  # the batch drawn above
    micro_batches, trainer.grad_accum_steps = trainer.grad_accum_steps, 1
    mode = SimulatedTensors(group_axes(trainer.parallel.meshes))
    with mode:
        for module in modules:
            module.to_empty(device=torch.device("cpu"))
        stepped = trainer.pipeline is None
        gradient_bytes = 0
        if stepped:
            mode.recording = True
            trainer.forward_backward()
            # Read before the optimizer step, which sets them to None.
            gradient_bytes = sum(_local_bytes(p.grad) for p in trainer.trained_params if p.grad is not None)
            trainer.optimizer_step()
            mode.live.rescan()
            mode.live.sample()
            mode.recording = False
        states = trainer.checkpointer.stateful()
        model_state = _global_shapes(states["model"].state_dict())
        optimizer_state = _global_shapes(states["optimizer"].state_dict())
    params = [p for module in modules for p in module.parameters()]
    optimizer_bytes = sum(
        _local_bytes(value)
        for state in trainer.optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return StepTrace(
        collectives=mode.collectives,
        seconds=time.perf_counter() - start,
        model_state=model_state,
        optimizer_state=optimizer_state,
        parameter_bytes=sum(_local_bytes(p) for p in params),
        gradient_bytes=gradient_bytes,
        optimizer_bytes=optimizer_bytes,
        step_peak_bytes=mode.live.peak,
        micro_batches_per_step=micro_batches,
        stepped=stepped,
        routed=mode.routing.used,
    )
