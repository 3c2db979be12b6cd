"""The accelerators the planner knows, and `--chips NAME-COUNT` parsed into a cluster.

What COUNT means: chips (GPUs for GPUs), for every generation. Google names v4 and v5p slices by
TensorCores ("v5p-128" is 64 chips) and v5e / v6e slices by chips; here `v5p-64` is 64 chips, so one
number means the same hardware on every line of a comparison (scripts/published_mfu.py names
slices the same way). A "device" is what one training process drives, the unit the parallelism
degrees multiply up to: one chip on v4 and v5p (their two TensorCores are fused into one "megacore"
device), v5e and v6e (one TensorCore each) and GPUs; on TPU7x (`v7x`) each chip's two TensorCores are
separate devices, as `titan_tpu/device/peak.py` counts them, so `v7x-64` is 128 processes.

Peak FLOP/s are not repeated here: they come from `titan_tpu.device.peak`'s table through the name
the runtime reports for the chip, so the planner and the trainer's MFU divide by the same number.

Bandwidths are the vendors' figures: TPU ICI as bidirectional GB/s per chip, DCN and InfiniBand as
Gb/s per chip / GPU (one direction), NVLink as total (bidirectional) GB/s per GPU.

The host link (chip <-> host memory, what FSDP CPU offload and activation offload move over), one
direction per chip: for TPUs the JAX scaling book's PCIe figure, 1.5e10 bytes/s ("How to Think About
TPUs", https://jax-ml.github.io/scaling-book/tpus/, used there for a v6e; Google publishes none per
generation, so every TPU here is assumed the same); for GPUs the vendor's PCIe generation x16, one
direction (A100: Gen4, 64 GB/s both ways; H100, H200, B200: Gen5, 128 GB/s both ways). Used as is,
not derated.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_tpu.config.errors import ConfigError
from titan_tpu.device.peak import device_generation, table_peak_flops

if TYPE_CHECKING:
    from titan_tpu.plan.calibration import Calibration

GIB = 2**30


@dataclass(frozen=True)
class ChipType:
    name: str  # as written in --chips
    runtime_name: str  # as the runtime reports it: the key into the peak FLOP/s table
    hbm_bytes: float  # per chip
    devices_per_chip: int  # PyTorch devices (training processes) per chip
    fast_link: str  # inside a slice / NVLink domain
    fast_bidirectional_bytes_per_s: float  # per chip
    # Fraction of a chip's fast links that one mesh axis's ring runs over: a TPU axis runs along
    # one or two of the torus' dimensions (half the ports, taken as the typical case); every GPU
    # of an NVSwitch domain reaches all others at its full NVLink bandwidth.
    link_share: float
    slow_link: str  # between slices / hosts
    slow_bytes_per_s: float | None  # per chip, one direction; None where no figure is published
    chips_per_host: int
    max_slice_chips: int  # the largest ICI slice (TPU) or NVLink domain (GPU)
    source: str  # the vendor page the figures come from
    host_link_bytes_per_s: float = 1.5e10  # per chip, one direction (see the module doc)

    def peak_flops_per_chip(self) -> float:
        """Dense bf16 FLOP/s of the whole chip: `device/peak.py`'s per-device figure, the one the
        trainer's MFU divides by, times the devices a chip runs as."""
        peak = table_peak_flops(self.runtime_name)
        if peak is None:  # a table entry was removed from peak.py: fail loudly, never guess
            raise ConfigError(f"{self.name}: no peak FLOP/s for '{self.runtime_name}' in device/peak.py")
        return peak * self.devices_per_chip


def _gbit(gbit_per_s: float) -> float:
    return gbit_per_s * 1e9 / 8


CHIP_TYPES: tuple[ChipType, ...] = (
    # https://cloud.google.com/tpu/docs/v4 (32 GiB HBM2, 4096-chip pod, 3D torus). ICI: the JAX
    # scaling book's v4 figure, 45 GB/s one way per link, 6 links (https://jax-ml.github.io/scaling-book/tpus/).
    # Google publishes no DCN figure for v4.
    ChipType(
        "v4",
        "TPU v4",
        32 * GIB,
        1,
        "ICI",
        6 * 2 * 45e9,
        0.5,
        "DCN",
        None,
        4,
        4096,
        "https://cloud.google.com/tpu/docs/v4",
    ),
    # https://cloud.google.com/tpu/docs/v5e: 16 GB HBM, 400 GB/s bidirectional ICI per chip, 8 chips
    # per host, 256-chip pod, 2 x 100 Gb/s NICs per 8-chip host (25 Gb/s per chip).
    ChipType(
        "v5e",
        "TPU v5e",
        16e9,
        1,
        "ICI",
        400e9,
        0.5,
        "DCN",
        _gbit(2 * 100 / 8),
        8,
        256,
        "https://cloud.google.com/tpu/docs/v5e",
    ),
    # https://cloud.google.com/tpu/docs/v5p: 95 GiB usable HBM, 1200 GB/s ICI, 50 Gb/s DCN per chip,
    # 4-chip hosts, largest slice 6144 chips.
    ChipType(
        "v5p",
        "TPU v5p",
        95 * GIB,
        1,
        "ICI",
        1200e9,
        0.5,
        "DCN",
        _gbit(50),
        4,
        6144,
        "https://cloud.google.com/tpu/docs/v5p",
    ),
    # https://cloud.google.com/tpu/docs/tpu7x (comparison table): v6e 32 GiB HBM, 800 GB/s ICI,
    # 100 Gb/s DCN per chip; https://cloud.google.com/tpu/docs/v6e: 8 chips per host, 256-chip pod.
    ChipType(
        "v6e",
        "TPU v6e",
        32 * GIB,
        1,
        "ICI",
        800e9,
        0.5,
        "DCN",
        _gbit(100),
        8,
        256,
        "https://cloud.google.com/tpu/docs/v6e",
    ),
    # https://cloud.google.com/tpu/docs/tpu7x: 192 GiB HBM, two TensorCores (two devices) per chip,
    # 1200 GB/s ICI, 100 Gb/s DCN per chip, 4-chip VMs, 9216-chip pod.
    ChipType(
        "v7x",
        "TPU v7x",
        192 * GIB,
        2,
        "ICI",
        1200e9,
        0.5,
        "DCN",
        _gbit(100),
        4,
        9216,
        "https://cloud.google.com/tpu/docs/tpu7x",
    ),
    # https://www.nvidia.com/en-us/data-center/a100/: A100 80GB SXM, 600 GB/s NVLink; DGX A100: one
    # 200 Gb/s HDR InfiniBand port per GPU, 8 GPUs per NVSwitch domain.
    ChipType(
        "a100",
        "NVIDIA A100-SXM4-80GB",
        80e9,
        1,
        "NVLink",
        600e9,
        1.0,
        "InfiniBand",
        _gbit(200),
        8,
        8,
        "https://www.nvidia.com/en-us/data-center/a100/",
        32e9,
    ),
    # https://www.nvidia.com/en-us/data-center/h100/: H100 SXM 80 GB, 900 GB/s NVLink; DGX H100: one
    # 400 Gb/s ConnectX-7 port per GPU.
    ChipType(
        "h100",
        "NVIDIA H100 80GB HBM3",
        80e9,
        1,
        "NVLink",
        900e9,
        1.0,
        "InfiniBand",
        _gbit(400),
        8,
        8,
        "https://www.nvidia.com/en-us/data-center/h100/",
        64e9,
    ),
    # https://www.nvidia.com/en-us/data-center/h200/: 141 GB HBM3e, 900 GB/s NVLink; DGX H200: one
    # 400 Gb/s port per GPU.
    ChipType(
        "h200",
        "NVIDIA H200",
        141e9,
        1,
        "NVLink",
        900e9,
        1.0,
        "InfiniBand",
        _gbit(400),
        8,
        8,
        "https://www.nvidia.com/en-us/data-center/h200/",
        64e9,
    ),
    # https://www.nvidia.com/en-us/data-center/dgx-b200/: 1440 GB of HBM3e over 8 GPUs (180 GB each),
    # 1.8 TB/s NVLink per GPU, 400 Gb/s ConnectX-7 port per GPU.
    ChipType(
        "b200",
        "NVIDIA B200",
        180e9,
        1,
        "NVLink",
        1800e9,
        1.0,
        "InfiniBand",
        _gbit(400),
        8,
        8,
        "https://www.nvidia.com/en-us/data-center/dgx-b200/",
        64e9,
    ),
)

_BY_NAME = {chip.name: chip for chip in CHIP_TYPES}
_PATTERN = re.compile(r"([a-z0-9]+)-([0-9]+)")


@dataclass(frozen=True)
class Cluster:
    """COUNT chips of one type, as one or more slices (TPU) or NVLink domains (GPU)."""

    chip: ChipType
    chips: int
    slices: int
    # Figures a doctor report measured on this chip (`--calibration`), used in place of the vendor's.
    calibration: Calibration | None = None

    @property
    def name(self) -> str:
        return f"{self.chip.name}-{self.chips}"

    @property
    def devices(self) -> int:
        return self.chips * self.chip.devices_per_chip

    @property
    def devices_per_slice(self) -> int:
        return self.devices // self.slices

    @property
    def hbm_bytes_per_device(self) -> float:
        return self.chip.hbm_bytes / self.chip.devices_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        return self.chip.peak_flops_per_chip() / self.chip.devices_per_chip

    def fast_bytes_per_s_per_device(self) -> float:
        """Bytes a device receives per second in a ring collective over its slice's links (one way)."""
        chip = self.chip
        return chip.fast_bidirectional_bytes_per_s / 2 * chip.link_share / chip.devices_per_chip

    def slow_bytes_per_s_per_device(self) -> float:
        if self.chip.slow_bytes_per_s is None:
            raise ConfigError(
                f"--chips {self.name}: {self.chips} chips span {self.slices} slices, but no {self.chip.slow_link} "
                f"bandwidth is published for {self.chip.name}; plan at most {self.chip.max_slice_chips} chips"
            )
        return self.chip.slow_bytes_per_s / self.chip.devices_per_chip


def chip_for_device(device_name: str) -> ChipType | None:
    """The chip whose runtime name falls under the same peak-table entry as `device_name` (the name
    a runtime reports, as a doctor report records it), or None."""
    generation = device_generation(device_name)
    if generation is None:
        return None
    return next((chip for chip in CHIP_TYPES if device_generation(chip.runtime_name) == generation), None)


def calibrated(cluster: Cluster, calibration: Calibration) -> Cluster:
    return dataclasses.replace(cluster, calibration=calibration)


def valid_chip_names() -> str:
    return ", ".join(f"{chip.name}-N" for chip in CHIP_TYPES) + " (N = chips)"


def parse_chips(text: str) -> Cluster:
    """'v6e-256' -> a Cluster; one line naming what is wrong and what is valid otherwise."""
    match = _PATTERN.fullmatch(text.strip().lower())
    chip = _BY_NAME.get(match.group(1)) if match else None
    if match is None or chip is None:
        raise ConfigError(f"--chips {text}: unknown accelerator; valid: {valid_chip_names()}, e.g. v6e-256")
    chips = int(match.group(2))
    if chips < 1:
        raise ConfigError(f"--chips {text}: the chip count must be at least 1")
    slice_chips = min(chips, chip.max_slice_chips)
    if chips % slice_chips:
        raise ConfigError(
            f"--chips {text}: {chips} chips do not split into whole slices of {chip.max_slice_chips} "
            f"(the largest {chip.name} {'slice' if chip.fast_link == 'ICI' else 'NVLink domain'})"
        )
    return Cluster(chip, chips, chips // slice_chips)
