"""Gradient-norm clipping over (possibly sharded) gradients, and the loss mean over data parallelism."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _group_by_mesh(parameters: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters with gradients, grouped so that foreach ops never mix meshes or layouts (FSDP,
    FSDP x TP and expert-parallel parameters can live on different meshes)."""
    groups: dict[tuple[object, ...], list[torch.Tensor]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key: tuple[object, ...] = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else ("local",)
        groups.setdefault(key, []).append(param)
    return list(groups.values())


def _total_norm(groups: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """The norm of all gradients together, as if they were one unsharded vector: each group's norm
    is reduced over its mesh, and the groups are combined here. Plain tensors are taken as they are
    (replicated, or a single process)."""
    norms: list[torch.Tensor] = []
    for params in groups:
        # Every parameter of a group has a gradient (`_group_by_mesh`); the test only narrows the type.
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # reduces the per-shard partial norms over the mesh
        norms.append(norm.float())
    if not norms:
        return torch.zeros(())
    target = norms[0].device
    stacked = torch.stack([n.to(target) for n in norms])
    if math.isinf(norm_type):
        return stacked.max()
    return torch.linalg.vector_norm(stacked, norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Scale every gradient so the global norm is at most `max_norm` (0 = only measure); returns the
    norm before clipping. With `pp_mesh` (pipeline parallelism) `parameters` are this rank's stages'
    and the norm is combined over every stage's ranks."""
    groups = _group_by_mesh(parameters)
    total = _total_norm(groups, norm_type)
    if pp_mesh is not None:
        total = _combine_over(total, pp_mesh, norm_type)
    if max_norm > 0:
        for params in groups:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _combine_over(norm: torch.Tensor, mesh: DeviceMesh, norm_type: float) -> torch.Tensor:
    """The norm of the vector made of every rank's part of `mesh`, from each part's `norm`."""
    if math.isinf(norm_type):
        norm = norm.clone()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return norm
    powered = norm.float() ** norm_type
    dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return (powered ** (1.0 / norm_type)).to(norm.dtype)


def sum_over(value: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """Sum of a per-rank tensor over the data-parallel ranks, left on the device (tp ranks hold equal
    copies and are not counted twice). None: single process, the value itself."""
    value = value.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if mesh is None or mesh.size() == 1:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value
