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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from titan_tpu.dryrun.collectives import Collective, collective_of, group_axes
from titan_tpu.dryrun.routing import NOT_HANDLED, EvenRouting, bins
from titan_tpu.dryrun.trainer import DryRunTrainer

_aten = torch.ops.aten


class SimulatedTensors(FakeTensorMode):
    """Fake tensors that record every collective and stand in for routing. Fake tensor mode is the
    mode every op reaches, also those a tensor subclass (DTensor) issues inside its own dispatch,
    which a mode stacked above it would not see."""

    def __init__(self, axes: dict[str, tuple[str, int]]) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.axes = axes
        self.collectives: list[Collective] = []
        self.routing = EvenRouting()
        self.recording = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.recording:
            answer = self.routing.before(func, args, kwargs)
            if answer is not NOT_HANDLED:
                return answer
        if self.recording and func is _aten.bincount.default:
            # Its size depends on the data: the routing stand-in gives it values, this its shape.
            out = super().__torch_dispatch__(_aten.new_zeros.default, types, (args[0], [bins(args, kwargs)]), {})
        else:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.recording:
            self.routing.after(func, args, kwargs, out)
            collective = collective_of(func, args, out, self.axes)
            if collective is not None:
                self.collectives.append(collective)
        return out


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
        micro_batches_per_step=micro_batches,
        stepped=stepped,
        routed=mode.routing.used,
    )
