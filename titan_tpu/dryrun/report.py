"""What one simulated rank's set-up and step showed, as a table and as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_tpu.dryrun.collectives import Collective
from titan_tpu.dryrun.step import StepTrace

GIB = 2**30


@dataclass(frozen=True)
class CollectiveRow:
    kind: str
    axis: str
    group_size: int
    count: int
    bytes: int


@dataclass(frozen=True)
class RankReport:
    config: str
    world: int
    rank: int
    layout: str
    setup_s: float
    step_s: float
    peak_rss_gib: float  # of this process: the simulation's own cost
    fsdp_units: int
    parameters: int  # tensors
    uneven_shards: int  # parameters whose sharded dimension does not split evenly over its shards
    empty_shards: int  # parameters of which this rank holds nothing
    state_where: str  # "device", or "host" under FSDP CPU offload
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    largest_gather_bytes: int  # the largest all-gather output of the step: one FSDP unit, gathered
    step_peak_bytes: int  # titan_tpu/dryrun/step.py StepTrace
    collectives: list[CollectiveRow]
    model_state: dict[str, list[int]]
    optimizer_state: dict[str, list[int]]
    notes: list[str] = field(default_factory=list)
    local_shapes: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def summarise(collectives: list[Collective]) -> list[CollectiveRow]:
    rows: dict[tuple[str, str, int], list[int]] = {}
    for c in collectives:
        row = rows.setdefault(c.key(), [0, 0])
        row[0] += 1
        row[1] += c.bytes
    return [CollectiveRow(kind, axis, size, n, b) for (kind, axis, size), (n, b) in sorted(rows.items())]


def shard_census(modules: list[nn.Module]) -> tuple[int, int, int, int, dict[str, list[int]]]:
    """(FSDP units, parameters, uneven, empty, local shapes) of this rank's modules."""
    units = sum(isinstance(m, FSDPModule) for module in modules for m in module.modules())
    uneven = empty = count = 0
    shapes: dict[str, list[int]] = {}
    for module in modules:
        for name, param in module.named_parameters():
            count += 1
            local = param.to_local() if isinstance(param, DTensor) else param
            shapes[name] = list(local.shape)
            if local.numel() == 0:
                empty += 1
            if isinstance(param, DTensor):
                mesh_sizes = param.device_mesh.shape
                for mesh_dim, placement in enumerate(param.placements):
                    dim = getattr(placement, "dim", None)
                    if dim is not None and param.shape[dim] % mesh_sizes[mesh_dim]:
                        uneven += 1
                        break
    return units, count, uneven, empty, shapes


def rank_report(
    config_name: str,
    world: int,
    rank: int,
    layout: str,
    setup_s: float,
    trace: StepTrace,
    modules: list[nn.Module],
    offloaded: bool,
    peak_rss_gib: float,
    notes: list[str],
) -> RankReport:
    units, count, uneven, empty, shapes = shard_census(modules)
    gathers = [c.bytes for c in trace.collectives if c.kind == "all_gather"]
    return RankReport(
        config=config_name,
        world=world,
        rank=rank,
        layout=layout,
        setup_s=round(setup_s, 2),
        step_s=round(trace.seconds, 2),
        peak_rss_gib=round(peak_rss_gib, 3),
        fsdp_units=units,
        parameters=count,
        uneven_shards=uneven,
        empty_shards=empty,
        state_where="host" if offloaded else "device",
        parameter_bytes=trace.parameter_bytes,
        gradient_bytes=trace.gradient_bytes,
        optimizer_bytes=trace.optimizer_bytes,
        largest_gather_bytes=max(gathers, default=0),
        step_peak_bytes=trace.step_peak_bytes,
        collectives=summarise(trace.collectives),
        model_state={k: list(v) for k, v in trace.model_state.items()},
        optimizer_state={k: list(v) for k, v in trace.optimizer_state.items()},
        notes=notes,
        local_shapes=shapes,
    )


def table(report: RankReport) -> str:
    lines = [
        f"dry run: {report.config} on {report.world} simulated ranks, rank {report.rank}: {report.layout}",
        f"  set-up {report.setup_s:.1f} s, step {report.step_s:.1f} s, this process {report.peak_rss_gib:.2f} GiB",
        f"  {report.parameters} parameters in {report.fsdp_units} FSDP units; {report.uneven_shards} sharded "
        f"unevenly, {report.empty_shards} empty on this rank",
        f"  state on {report.state_where}: parameters {report.parameter_bytes / GIB:.3f} GiB, gradients "
        f"{report.gradient_bytes / GIB:.3f} GiB, optimizer {report.optimizer_bytes / GIB:.3f} GiB; largest "
        f"gathered unit {report.largest_gather_bytes / GIB:.3f} GiB",
        f"  the step's own tensors peaked at {report.step_peak_bytes / GIB:.3f} GiB (activations, gathered "
        f"parameters, gradients{', which FSDP moves to the host' if report.state_where == 'host' else ''})"
        f"{later_step_line(report)}",
        f"  checkpoint: {len(report.model_state)} model keys, {len(report.optimizer_state)} optimizer keys",
        "  collectives of one micro-batch and the optimizer step (bytes: the whole buffer, see collectives.py):",
        f"    {'kind':<15}{'axis':<18}{'group':>7}{'count':>8}{'GiB':>12}",
    ]
    for row in report.collectives:
        lines.append(f"    {row.kind:<15}{row.axis:<18}{row.group_size:>7}{row.count:>8}{row.bytes / GIB:>12.3f}")
    lines.extend(f"  note: {note}" for note in report.notes)
    return "\n".join(lines)


def later_step_line(report: RankReport) -> str:
    """A later step also holds the parameters and the optimizer state throughout, on the device
    unless FSDP offloads them."""
    if report.state_where == "host":
        return ""
    later = report.step_peak_bytes + report.parameter_bytes + report.optimizer_bytes
    return f"; a later step, with the parameters and optimizer state: {later / GIB:.3f} GiB"


def write_report(report: RankReport, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"world-{report.world}-rank-{report.rank}.json"
    path.write_text(report.to_json())
    return path


def load_report(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))
