"""What the planner's estimates are checked against: bytes actually held by a trained model's
parameters, gradients and AdamW state on this process, and the peak of live activation bytes of a
forward + backward. Shared by the planner's unit and multi-process tests."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this process stores for `tensor`: a DTensor's local shard, a plain tensor whole."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def measure_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients (they must exist: call after a backward) and optimizer state tensors."""
    params = list(model.parameters())
    assert all(p.grad is not None for p in params), "measure after a backward, before zero_grad"
    optimizer_bytes = sum(
        local_bytes(value) for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    )
    return {
        "parameters": sum(local_bytes(p) for p in params),
        "gradients": sum(local_bytes(p.grad) for p in params),  # type: ignore[arg-type]
        "optimizer": optimizer_bytes,
    }


def within(estimate: float, measured: float, tolerance: float) -> bool:
    """The comparison every planner check uses: |estimate - measured| <= tolerance x measured."""
    return abs(estimate - measured) <= tolerance * measured


class LiveTensorPeak(TorchDispatchMode):
    """Peak bytes of tensor storages created by ops run under this mode and still alive.

    Every op's outputs are seen here; a storage is counted once, from its first appearance until
    the last reference to it dies (a weak-reference finalizer on the storage object, which PyTorch
    keeps alive as long as the storage itself). Storages that exist before the mode (parameters,
    gradients, optimizer state: pass them as `existing`) are never counted, also when an op returns
    a view of them. This is what an accelerator's allocator peak would read for activations and
    temporaries, without the CPU allocator's caching and fragmentation that blur the process's
    resident-set size.
    """

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: Any = weakref.WeakSet(t.untyped_storage() for t in existing)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor):
                storage = tensor.untyped_storage()
                if storage in self._seen:
                    continue
                self._seen.add(storage)
                size = storage.nbytes()
                self.live += size
                weakref.finalize(storage, self._free, size)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, size: int) -> None:
        self.live -= size
