"""Plain data parallelism: every rank holds the whole model, gradients are averaged after backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


@torch.no_grad()
def average_gradients(model: nn.Module, world_size: int) -> None:
    """All-reduce every gradient once per optimizer step, in one flat buffer per dtype."""
    if world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        # gloo has no AVG reduction; sum then divide works on every backend.
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world_size
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
