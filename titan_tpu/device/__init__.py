"""The one place that names device types.

Everything else asks this package for the device and its process-group backend, synchronisation,
per-window peak memory, the device's name, the compute dtype it runs natively and its peak FLOP/s.

- `select`: detection through `torch.accelerator` (TPUs via the `torch_tpu` package), `Device`.
- `dtype`: the compute-dtype decision and the one table of dtype names.
- `memory`: the CPU's per-window peak memory.
- `peak`: peak FLOP/s for MFU (published table, or the CPU probe shared per host).
- `tpu_api`: every torch_tpu function the project calls, by public path.
- `tpu_runtime`: what a process without TPU device files sets before torch loads.
- `tracing`: what `torch.profiler` records on each device type (`[profiling]`).

The names below are loaded from their modules on first use, so that importing
`titan_tpu.device.tpu_runtime` imports no torch: the entry points call it before `import torch`,
which would otherwise already have loaded torch_tpu.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names __getattr__ loads, for type checkers
    from titan_tpu.device.dtype import DTYPES, dtype_from_name, dtype_name, native_bf16, resolve_compute_dtype
    from titan_tpu.device.peak import host_peak_flops
    from titan_tpu.device.select import (
        Device,
        DeviceType,
        accelerator_type,
        available,
        process_group_backend,
        resolve_device_type,
        select_device,
        torch_tpu_version,
    )
    from titan_tpu.device.tpu_api import TORCH_TPU_CALLS, torch_tpu_function

# Public name -> the module of this package that defines it.
_HOME_MODULE: dict[str, str] = {
    "DTYPES": "dtype",
    "dtype_from_name": "dtype",
    "dtype_name": "dtype",
    "native_bf16": "dtype",
    "resolve_compute_dtype": "dtype",
    "host_peak_flops": "peak",
    "Device": "select",
    "DeviceType": "select",
    "accelerator_type": "select",
    "available": "select",
    "process_group_backend": "select",
    "resolve_device_type": "select",
    "select_device": "select",
    "torch_tpu_version": "select",
    "TORCH_TPU_CALLS": "tpu_api",
    "torch_tpu_function": "tpu_api",
}

__all__ = sorted(_HOME_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _HOME_MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME_MODULE[name]}"), name)
    globals()[name] = value  # later look-ups (and monkeypatching) see a plain module attribute
    return value
