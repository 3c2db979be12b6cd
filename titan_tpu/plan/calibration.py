"""`--calibration REPORT.json`: a doctor report's measured figures in place of the vendor's.

The report is the JSON file `python -m titan_tpu.doctor` writes (docs/doctor.md lists its fields);
the planner reads only its `device` and `measured` sections, and nothing of the doctor's code. A
report is used only for the chip it was measured on: its device name must fall under the same
peak-table entry (`titan_tpu/device/peak.py`) as the `--chips` type, so a v5e's figures never plan
a v6e, nor a CPU's any accelerator.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_tpu.config.errors import ConfigError
from titan_tpu.device.peak import device_generation
from titan_tpu.plan.chips import ChipType

REPORT_FORMAT = "titan_tpu doctor report"


@dataclass(frozen=True)
class Calibration:
    source: str  # the report's path, for the plan's output
    device: str  # the device name the figures were measured on
    matmul_flops: dict[str, float]  # dtype name -> FLOP/s of one device
    bus_bytes_per_s: dict[str, dict[str, float]]  # "fast" / "slow" -> collective -> bytes/s a device receives


def _numbers(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in value.values()):
        raise ValueError(f"{where} is not a table of positive numbers")
    return {str(k): float(v) for k, v in value.items()}


def load_calibration(path: str, chip: ChipType) -> Calibration:
    """The report at `path` for `chip`; one line (ConfigError) when it cannot be read or was
    measured on other hardware."""
    where = f"--calibration {path}"
    try:
        report = json.loads(Path(path).read_text("utf-8"))
        if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
            raise ValueError(f'not a doctor report (no "format": "{REPORT_FORMAT}")')
        device = str(report["device"]["name"])
        measured = report["measured"]
        matmul = _numbers(measured["matmul_flops"], "measured.matmul_flops")
        bus = {
            link: _numbers(table, f"measured.bus_bytes_per_s.{link}")
            for link, table in measured["bus_bytes_per_s"].items()
        }
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{where}: cannot be used ({error}); write one with python -m titan_tpu.doctor") from None
    generation = device_generation(device)
    if generation is None or generation != device_generation(chip.runtime_name):
        raise ConfigError(
            f"{where}: measured on '{device}', not on --chips {chip.name} ('{chip.runtime_name}'); "
            f"run the doctor on a {chip.name} or plan without --calibration"
        )
    return Calibration(path, device, matmul, bus)
