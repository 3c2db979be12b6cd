"""The one place that names device types.

Everything else asks this package for the device and its process-group backend, synchronisation,
per-window peak memory, the device's name, the compute dtype it runs natively and its peak FLOP/s.

- `select`: detection through `torch.accelerator` (TPUs via the `torch_tpu` package), `Device`.
- `dtype`: the compute-dtype decision and the one table of dtype names.
- `memory`: the CPU's per-window peak memory.
- `peak`: peak FLOP/s for MFU (published table, or the CPU probe shared per host).
- `tpu_api`: every torch_tpu function the project calls, by public path.
"""

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
from titan_tpu.device.dtype import DTYPES, dtype_from_name, dtype_name, native_bf16, resolve_compute_dtype
from titan_tpu.device.tpu_api import TORCH_TPU_CALLS, torch_tpu_function
from titan_tpu.device.peak import host_peak_flops

__all__ = [
    "DTYPES",
    "TORCH_TPU_CALLS",
    "Device",
    "DeviceType",
    "accelerator_type",
    "available",
    "dtype_from_name",
    "dtype_name",
    "host_peak_flops",
    "native_bf16",
    "process_group_backend",
    "resolve_compute_dtype",
    "resolve_device_type",
    "select_device",
    "torch_tpu_function",
    "torch_tpu_version",
]
