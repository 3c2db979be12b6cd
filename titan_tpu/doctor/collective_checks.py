"""All-gather, reduce-scatter, all-reduce and all-to-all over every mesh axis of size > 1, as bus
bandwidth against the bandwidth the planner assumes.

Bus bandwidth (nccl-tests' definition, and the rate the planner's ring model charges): with n ranks
in the group, S the bytes of the full buffer (the gathered output of an all-gather, the input of a
reduce-scatter, the buffer of an all-reduce or all-to-all) and t the time of one call,

    all-gather, reduce-scatter, all-to-all:  busbw = S / t * (n - 1) / n
    all-reduce:                              busbw = S / t * 2 (n - 1) / n

t is the median of the timed calls on a rank, then the largest over all ranks (a collective is as
slow as its slowest member). Every group of an axis runs at once, as in training.

Expected figure: on an accelerator, the planner's per-device bandwidth for the link the axis runs
over (`expected.py`): the slow link (DCN) for dp_replicate across TPU slices, or (GPUs) an axis whose
group spans hosts; the fast link (ICI, NVLink) otherwise. On a CPU (gloo over loopback) no vendor
publishes a figure, so each row is held against the median of all rows of this run: the same
memory and the same gloo paths carry every collective, and one far below its siblings has taken a
slow path (or been slowed on purpose, as the tests do). gloo's collectives differ among themselves
more than ring collectives on an interconnect do (0.4x to 4.6x of their median at 1 MiB over
4 processes on a 2-core EPYC), so there the line is CPU_SLOW_FRACTION, a tenth of the median.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_tpu.device.select import Device
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.distributed.topology import build_rank_layout, tpu_slice_count
from titan_tpu.doctor.expected import planner_bus_bandwidth
from titan_tpu.doctor.rows import SLOW_FRACTION, Row, speed_verdict
from titan_tpu.doctor.sizes import Sizes

CPU_SLOW_FRACTION = 0.1


@dataclass(frozen=True)
class Collective:
    name: str
    bus_factor: Callable[[int], float]  # n -> busbw / algbw
    # (full-buffer elements, group size, device) -> a call that runs the collective once on `group`
    prepare: Callable[[int, int, torch.device], Callable[[dist.ProcessGroup], None]]


def _all_gather(elements: int, n: int, device: torch.device) -> Callable[[dist.ProcessGroup], None]:
    shard, full = torch.ones(elements // n, device=device), torch.empty(elements // n * n, device=device)
    return lambda group: dist.all_gather_into_tensor(full, shard, group=group)


def _reduce_scatter(elements: int, n: int, device: torch.device) -> Callable[[dist.ProcessGroup], None]:
    full, shard = torch.ones(elements // n * n, device=device), torch.empty(elements // n, device=device)
    return lambda group: dist.reduce_scatter_tensor(shard, full, group=group)


def _all_reduce(elements: int, n: int, device: torch.device) -> Callable[[dist.ProcessGroup], None]:
    buffer = torch.ones(elements, device=device)
    return lambda group: dist.all_reduce(buffer, group=group)


def _all_to_all(elements: int, n: int, device: torch.device) -> Callable[[dist.ProcessGroup], None]:
    sent, received = torch.ones(elements // n * n, device=device), torch.empty(elements // n * n, device=device)
    return lambda group: dist.all_to_all_single(received, sent, group=group)


def _ring(n: int) -> float:
    return (n - 1) / n


# The collectives the mesh uses: FSDP gathers and scatters, HSDP all-reduces, EP all-to-alls. A
# module-level tuple, so a test can slow one down (the doctor's negative control for "slow").
COLLECTIVES: tuple[Collective, ...] = (
    Collective("all_gather", _ring, _all_gather),
    Collective("reduce_scatter", _ring, _reduce_scatter),
    Collective("all_reduce", lambda n: 2 * _ring(n), _all_reduce),
    Collective("all_to_all", _ring, _all_to_all),
)


@dataclass(frozen=True)
class Axis:
    name: str
    size: int
    group: dist.ProcessGroup
    fast: bool  # inside a slice / host, or across them


def mesh_axes(dims: ParallelDims, device: Device) -> list[Axis]:
    """Every axis of size > 1 of the mesh the trainer would build for `dims`, with its link."""
    names, sizes = dims.mesh_axes()
    layout = build_rank_layout(device.type, names, sizes, dist.get_rank())
    meshes = dims.build_meshes(device.type, layout)
    hosts: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    axes = []
    for name, size in zip(names, sizes):
        if size == 1:
            continue
        mesh = meshes[name]
        if device.type == "tpu":
            fast = not (name == "dp_replicate" and tpu_slice_count() > 1)  # only dp_replicate crosses DCN
        else:
            fast = len({hosts[int(rank)] for rank in mesh.mesh.flatten()}) == 1
        axes.append(Axis(name, size, mesh.get_group(), fast))
    return axes


def _seconds(run: Callable[[dist.ProcessGroup], None], axis: Axis, iterations: int, device: Device) -> float:
    run(axis.group)  # warm-up: connections, buffers
    times = []
    for _ in range(iterations):
        device.synchronize()
        start = time.perf_counter()
        run(axis.group)
        device.synchronize()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # on the CPU side: gloo under every backend
    return float(slowest)


def collective_rows(dims: ParallelDims, device: Device, sizes: Sizes) -> list[Row]:
    """Every rank calls it (collectives)."""
    if dims.world_size == 1:
        return [
            Row(
                "collective",
                "collectives",
                None,
                None,
                "",
                "unavailable",
                "one process: no mesh axis of size > 1 (run under torchrun or titan-launch)",
            )
        ]
    axes = mesh_axes(dims, device)
    elements = sizes.collective_bytes // 4  # float32
    measured: list[tuple[Collective, Axis, float]] = []
    for axis in axes:
        for collective in COLLECTIVES:
            run = collective.prepare(elements, axis.size, device.torch_device)
            seconds = _seconds(run, axis, sizes.collective_iterations, device)
            full_bytes = elements // axis.size * axis.size * 4
            measured.append((collective, axis, full_bytes / seconds * collective.bus_factor(axis.size)))
    median = statistics.median(bus for _, _, bus in measured)
    rows = []
    for collective, axis, bus in measured:
        expected: float | None  # the planner has no figure for some chips
        if device.type == "cpu":
            expected, source = median, "no vendor figure on a CPU: the median of this run's collectives"
            fraction = CPU_SLOW_FRACTION
        else:
            expected, source = planner_bus_bandwidth(device.name(), axis.fast, collective.name)
            fraction = SLOW_FRACTION
        verdict, ratio = speed_verdict(bus, expected, fraction=fraction)
        reason = source if expected is None else f"{ratio}: {source}"
        rows.append(
            Row(
                "collective",
                f"{collective.name} over {axis.name} ({axis.size})",
                bus / 1e9,
                None if expected is None else expected / 1e9,
                "GB/s",
                verdict,
                f"bus bandwidth, {sizes.collective_bytes / 2**20:.0f} MiB; {reason}",
                detail="fast" if axis.fast else "slow",
            )
        )
    return rows
