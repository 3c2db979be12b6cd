"""Every collective one simulated rank issues, recorded at the dispatcher: kind, mesh axis, group size
and bytes.

The convention for `bytes`: the whole buffer the collective is about, in the dtype it moves. An
all-gather counts its gathered output, a reduce-scatter its unreduced input (the two are the same
size), an all-reduce and a broadcast their tensor, an all-to-all what this rank hands in (its own
share included), a send or receive its tensor. A ring moves (n - 1) / n of it over each device's
links (the planner's model, titan_tpu/plan/roofline.py), which the caller applies.

Both families of torch's collectives are seen: the c10d ops FSDP2 calls (`all_gather_into_tensor`,
`reduce_scatter_tensor`, `all_reduce`) and the functional ones DTensor, expert and context
parallelism use. They are read where the fake tensors are made (titan_tpu/dryrun/step.py), the one
mode every op reaches, those DTensor issues inside its own dispatch included. The autograd wrappers
of functional collectives call the plain ones underneath, so only the plain ones are counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_leaves

_c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional

# op -> (kind, where its buffer is: "out" the result, an int the positional argument)
_OPS: dict[Any, tuple[str, str | int]] = {
    _c10d._allgather_base_.default: ("all_gather", 0),
    _c10d.allgather_.default: ("all_gather", 0),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1),
    _c10d.allreduce_.default: ("all_reduce", 0),
    _c10d.broadcast_.default: ("broadcast", 0),
    _c10d.alltoall_base_.default: ("all_to_all", 1),
    _c10d.alltoall_.default: ("all_to_all", 1),
    _c10d.send.default: ("send", 0),
    _c10d.recv_.default: ("recv", 0),
    _c10d.barrier.default: ("barrier", 0),
    _functional.all_gather_into_tensor.default: ("all_gather", "out"),
    _functional.all_gather_into_tensor_out.default: ("all_gather", "out"),
    _functional.all_gather_into_tensor_coalesced.default: ("all_gather", "out"),
    _functional.reduce_scatter_tensor.default: ("reduce_scatter", 0),
    _functional.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", 0),
    _functional.all_reduce.default: ("all_reduce", 0),
    _functional.all_reduce_.default: ("all_reduce", 0),
    _functional.all_reduce_coalesced.default: ("all_reduce", 0),
    _functional.all_to_all_single.default: ("all_to_all", 0),
    _functional.broadcast.default: ("broadcast", 0),
    _functional.isend.default: ("send", 0),
    _functional.irecv.default: ("recv", 0),
}


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, send, recv, barrier
    axis: str  # the mesh axis (or flattened axes) of its group, "world", or "other"
    group_size: int
    bytes: int  # the module doc's convention

    def key(self) -> tuple[str, str, int]:
        return self.kind, self.axis, self.group_size


def group_axes(meshes: Mapping[str, DeviceMesh]) -> dict[str, tuple[str, int]]:
    """Process-group name -> (the mesh axis it spans, its size), for every axis of every named mesh;
    a multi-axis mesh's own groups are its dimensions' ("dp_replicate" and "dp_shard" of HSDP)."""
    axes: dict[str, tuple[str, int]] = {}
    for name, mesh in meshes.items():
        dim_names = mesh.mesh_dim_names or (name,)
        for index, dim_name in enumerate(dim_names):
            group = mesh.get_group(index)
            axes.setdefault(group.group_name, (dim_name if mesh.ndim > 1 else name, group.size()))
    # Last: an axis that spans every rank (dp_shard alone) may be served by the default group.
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None:
        axes.setdefault(world.group_name, ("world", world.size()))
    return axes


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _group_name(func: Any, args: tuple[Any, ...]) -> str | None:
    """A c10d op takes its group as an object; a functional one by name, as its last string
    argument (a reduce op's name, "sum", comes before it)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return dist.ProcessGroup.unbox(arg).group_name
    names = [arg for arg in args if isinstance(arg, str)]
    return names[-1] if names else None


def collective_of(func: Any, args: tuple[Any, ...], out: Any, axes: Mapping[str, tuple[str, int]]) -> Collective | None:
    """The collective `func` ran (None for any other op), for the group it ran on."""
    known = _OPS.get(func)
    if known is None:
        return None
    kind, where = known
    axis, size = axes.get(_group_name(func, args) or "", ("other", 0))
    buffer = out if isinstance(where, str) else args[where]
    return Collective(kind, axis, size, 0 if kind == "barrier" else _nbytes(buffer))
