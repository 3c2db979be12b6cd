"""Activation offload: what a checkpointed block keeps for its backward waits in host memory.

A checkpointed block keeps its inputs (the residual stream entering it) until backward recomputes
it; compiled, it keeps whatever its compiled graph saves. `offload_saved_tensors` runs the block's
forward under saved-tensor hooks that copy each such tensor to host memory when autograd saves it
and back to the block's device when backward unpacks it, just before the recomputation that needs
it. The copies are issued non-blocking (into pinned memory on CUDA), so the host does not wait on
them. The hooks are forward hooks of the block, not a wrapper module: parameter names, and so
checkpoints and the sharding-invariant init, are the same with and without offload. The recompute
calls the block's inner forward, outside them, so nothing is offloaded twice.

Not moved: parameters (FSDP owns them), and tensors the block is handed that take no gradient
(rotary tables, masks, document ids: the same for every block of the step, so each block's copy
would repeat the others'). On a CPU host every tensor is in host memory already and the hooks keep
it as it is: the same code path, no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

HOST = torch.device("cpu")


def in_host_memory(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


class OnHost:
    """A saved tensor's host copy and the device it goes back to."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=tensor.device.type == "cuda")
        self.host.copy_(tensor, non_blocking=True)

    def restore(self) -> torch.Tensor:
        return self.host.to(self.device, non_blocking=True)


def _pack_for(shared: set[int]) -> Callable[[torch.Tensor], torch.Tensor | OnHost]:
    def pack(tensor: torch.Tensor) -> torch.Tensor | OnHost:
        if isinstance(tensor, nn.Parameter) or in_host_memory(tensor) or tensor.untyped_storage().data_ptr() in shared:
            return tensor
        return OnHost(tensor)

    return pack


def _unpack(saved: torch.Tensor | OnHost) -> torch.Tensor:
    return saved.restore() if isinstance(saved, OnHost) else saved


def offload_saved_tensors(block: nn.Module) -> None:
    """Hold in host memory what autograd saves during `block`'s forward (see the module doc)."""
    active: list[saved_tensors_hooks] = []

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shared = {
            value.untyped_storage().data_ptr()
            for value in (*args, *kwargs.values())
            if isinstance(value, torch.Tensor) and not value.requires_grad
        }
        hooks = saved_tensors_hooks(_pack_for(shared), _unpack)
        hooks.__enter__()
        active.append(hooks)

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        active.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter, with_kwargs=True)
    # always_call: a forward that raises still leaves the hooks, or every later save would be offloaded.
    block.register_forward_hook(leave, always_call=True)


def apply_activation_offload(
    containers: list[nn.ModuleDict | nn.ModuleList], is_checkpointed: Callable[[int], bool]
) -> None:
    """Offload the saved tensors of every checkpointed block (`is_checkpointed(index)`, counted across
    containers as activation checkpointing counts them)."""
    every_block = (block for container in containers for block in container.children())
    for index, block in enumerate(every_block):
        if is_checkpointed(index):
            offload_saved_tensors(block)
