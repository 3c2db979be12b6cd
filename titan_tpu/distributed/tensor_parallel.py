"""Model-independent pieces of tensor parallelism; the per-model plans live beside the models
(`titan_tpu/models/<family>/parallelize.py`) and use these."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel


def loss_context(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Wrap the loss *and* its backward: with vocab-sharded logits the cross-entropy is computed
    without gathering the vocabulary (`torch.distributed.tensor.parallel.loss_parallel`)."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def to_replicated_dtensor(tensor: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """A tensor that every tp rank holds whole (or a DTensor of any layout) as a Replicate DTensor."""
    if isinstance(tensor, DTensor):
        return tensor.redistribute(tp_mesh, [Replicate()])
    return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False)


def install_logits_layout(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel_enabled: bool) -> None:
    """Whatever layout the last layer leaves the logits in, hand the loss either a plain replicated
    tensor or, with loss parallel, a DTensor sharded over the vocabulary (last) dimension.

    Needed for tied embeddings, where the head is `F.linear(h, tok_embeddings.weight)` inside the
    model's forward and no parallel style sits on an output module."""

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, DTensor):
            return output
        if loss_parallel_enabled:
            return output.redistribute(tp_mesh, [Shard(output.ndim - 1)])
        return output.redistribute(tp_mesh, [Replicate()]).to_local()

    model.register_forward_hook(hook)


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the tp mesh (as DTensors), inputs and outputs plain tensors that
    every tp rank holds whole: a module that runs unsharded inside a tensor-parallel model."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def input_fn(mod: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_fn(mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for logging: a (replicated) DTensor scalar becomes its full value."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
