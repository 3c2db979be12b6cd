"""What the planner assumes about a device, for the doctor to measure against: the same functions
`python -m titan_tpu.plan` estimates with, for the chip the device's name falls under."""

from __future__ import annotations

from titan_tpu.plan.chips import Cluster, chip_for_device
from titan_tpu.plan.roofline import assumed_bus_bandwidth


def planner_bus_bandwidth(device_name: str, fast: bool, kind: str) -> tuple[float | None, str]:
    """(bytes/s, where the figure comes from) of one collective on one kind of link as the planner
    assumes it without a calibration; None when the planner has no figure for this device or link."""
    chip = chip_for_device(device_name)
    if chip is None:
        return None, f"'{device_name}' is not a chip the planner knows (titan_tpu/plan/chips.py)"
    link = chip.fast_link if fast else chip.slow_link
    if not fast and chip.slow_bytes_per_s is None:
        return None, f"no {link} figure is published for {chip.name}"
    return assumed_bus_bandwidth(Cluster(chip, 1, 1), fast, (kind,)), f"the planner's {chip.name} {link} figure"
