"""GKE TPU slices: which accelerator types and topologies GKE schedules, and how many hosts each has.

A GKE TPU node pool is selected by two node labels, `cloud.google.com/gke-tpu-accelerator` (the
accelerator type below) and `cloud.google.com/gke-tpu-topology` (the slice's chip grid, "4x4" or
"2x2x2"). Every host (VM, one Kubernetes node) of a slice holds the same number of chips, so a
topology fixes the number of hosts, and with it the number of pods a JobSet runs per slice.

Sources (GKE and Cloud TPU documentation):
- GKE topology table, machine types, single- vs multi-host node pools:
  https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus
- TPU v4 topology rule (AxBxC, A<=B<=C, sides <= 4 or multiples of 4) and the 4096-chip Pod:
  https://cloud.google.com/tpu/docs/types-topologies and https://cloud.google.com/tpu/docs/v4
- TPU v5e: 4-chip VMs in multi-host slices (a v5litepod-16, 4x4, is four VMs of four chips):
  https://cloud.google.com/tpu/docs/tpus-in-gke and https://cloud.google.com/tpu/docs/v5e
- TPU v5p: 4 chips per host; largest single slice 6144 chips:
  https://cloud.google.com/tpu/docs/v5p
- TPU v6e (Trillium): https://cloud.google.com/tpu/docs/v6e
- Ironwood (TPU7x): four chips per VM, 9216-chip Pod:
  https://cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood and
  https://cloud.google.com/tpu/docs/tpu7x
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.values import did_you_mean

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"

_TOPOLOGY = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*)+")
# 3D slices smaller than a 4x4x4 cube that GKE offers; above them every side is a multiple of 4.
_SUB_CUBES = ("2x2x2", "2x2x4", "2x4x4")
# The 2D multi-host topologies of v5e and v6e (4-chip VMs).
_GRID_2D = ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


@dataclass(frozen=True)
class HostLayout:
    """One row group of GKE's topology table: a machine type, its chips, the topologies it forms."""

    machine_type: str
    chips_per_host: int
    topologies: tuple[str, ...]
    # 3D types also take every AxBxC with A <= B <= C, all multiples of 4, up to this many chips.
    cubes_up_to_chips: int | None = None

    def holds(self, topology: str) -> bool:
        if topology in self.topologies:
            return True
        if self.cubes_up_to_chips is None:
            return False
        sides = [int(side) for side in topology.split("x")]
        return (
            len(sides) == 3
            and sides == sorted(sides)
            and all(side % 4 == 0 for side in sides)
            and math.prod(sides) <= self.cubes_up_to_chips
        )

    def describe(self) -> list[str]:
        """The topologies as a person reads them, the rule last."""
        listed = list(self.topologies)
        if self.cubes_up_to_chips is not None:
            listed.append(
                f"AxBxC with A<=B<=C all multiples of 4 up to {self.cubes_up_to_chips} chips (4x4x4, 4x4x8, ...)"
            )
        return listed


@dataclass(frozen=True)
class Accelerator:
    name: str  # the node-selector value
    tpu: str  # what people call it
    dims: int  # sides in a topology string
    layouts: tuple[HostLayout, ...]  # in order of preference when a topology fits more than one
    # Devices the TPU runtime shows per chip: two on Ironwood, whose chip holds two TensorCores that
    # each appear as a device of their own (https://cloud.google.com/tpu/docs/tpu7x), else one.
    devices_per_chip: int = 1

    def topologies(self) -> list[str]:
        seen: list[str] = []
        for layout in self.layouts:
            seen.extend(item for item in layout.describe() if item not in seen)
        return seen


def _cube_type(name: str, tpu: str, machine_prefix: str, max_chips: int, devices_per_chip: int = 1) -> Accelerator:
    """v4, v5p and TPU7x: 4-chip hosts, one host for 2x2x1, 3D topologies above it."""
    machine = f"{machine_prefix}-4t"
    return Accelerator(
        name,
        tpu,
        3,
        (HostLayout(machine, 4, ("2x2x1",)), HostLayout(machine, 4, _SUB_CUBES, cubes_up_to_chips=max_chips)),
        devices_per_chip,
    )


def _grid_type(name: str, tpu: str, machine_prefix: str) -> Accelerator:
    """v5e and v6e: 1-, 4- and 8-chip single-host machines; multi-host slices on 4-chip hosts.

    2x4 is both: one 8-chip host, or two 4-chip hosts (GKE offers both node pools). The single host
    is listed first, so it is the default; multi-slice jobs need the multi-host form.
    """
    return Accelerator(
        name,
        tpu,
        2,
        (
            HostLayout(f"{machine_prefix}-1t", 1, ("1x1",)),
            HostLayout(f"{machine_prefix}-4t", 4, ("2x2",)),
            HostLayout(f"{machine_prefix}-8t", 8, ("2x4",)),
            HostLayout(f"{machine_prefix}-4t", 4, _GRID_2D),
        ),
    )


ACCELERATORS: dict[str, Accelerator] = {
    acc.name: acc
    for acc in (
        _cube_type("tpu-v4-podslice", "TPU v4", "ct4p-hightpu", 4096),
        _grid_type("tpu-v5-lite-podslice", "TPU v5e", "ct5lp-hightpu"),
        _cube_type("tpu-v5p-slice", "TPU v5p", "ct5p-hightpu", 6144),
        _grid_type("tpu-v6e-slice", "TPU v6e (Trillium)", "ct6e-standard"),
        _cube_type("tpu7x", "Ironwood (TPU7x)", "tpu7x-standard", 9216, devices_per_chip=2),
    )
}


@dataclass(frozen=True)
class SliceShape:
    """One TPU slice: its chips, and the hosts (one pod each) that hold them."""

    accelerator: str
    topology: str
    chips: int
    hosts: int
    chips_per_host: int
    machine_type: str
    devices_per_chip: int = 1

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def devices(self) -> int:
        """The slice's devices as the TPU runtime counts them (what tensor parallelism splits over)."""
        return self.chips * self.devices_per_chip


def slice_shape(accelerator: str, topology: str, chips_per_host: int | None = None) -> SliceShape:
    """The slice GKE builds for (accelerator, topology); `chips_per_host` picks between the two forms
    of a v5e/v6e 2x4. Raises ConfigError naming the valid values."""
    acc = ACCELERATORS.get(accelerator)
    if acc is None:
        names = sorted(ACCELERATORS)
        raise ConfigError(
            f"accelerator '{accelerator}' is not a GKE TPU accelerator type; "
            f"{did_you_mean(accelerator, names)}valid: {', '.join(names)}"
        )
    valid = f"valid {acc.dims}D topologies for {acc.name} ({acc.tpu}): {', '.join(acc.topologies())}"
    if not _TOPOLOGY.fullmatch(topology) or topology.count("x") + 1 != acc.dims:
        raise ConfigError(f"topology '{topology}' is not a {acc.dims}D topology; {valid}")
    layouts = [layout for layout in acc.layouts if layout.holds(topology)]
    if not layouts:
        raise ConfigError(f"topology '{topology}' is not offered for {acc.name}; {valid}")
    if chips_per_host is not None:
        offered = sorted({layout.chips_per_host for layout in layouts})
        layouts = [layout for layout in layouts if layout.chips_per_host == chips_per_host]
        if not layouts:
            raise ConfigError(
                f"chips per host {chips_per_host} is not offered for {acc.name} {topology}; "
                f"valid: {', '.join(map(str, offered))}"
            )
    layout = layouts[0]
    chips = math.prod(int(side) for side in topology.split("x"))
    return SliceShape(
        accelerator=acc.name,
        topology=topology,
        chips=chips,
        hosts=chips // layout.chips_per_host,
        chips_per_host=layout.chips_per_host,
        machine_type=layout.machine_type,
        devices_per_chip=acc.devices_per_chip,
    )


def multi_host_alternative(shape: SliceShape) -> int | None:
    """Chips per host of a multi-host form of the same topology, if GKE offers one (v5e/v6e 2x4)."""
    for layout in ACCELERATORS[shape.accelerator].layouts:
        if layout.holds(shape.topology) and shape.chips // layout.chips_per_host > 1:
            return layout.chips_per_host
    return None
