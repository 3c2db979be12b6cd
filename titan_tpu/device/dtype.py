"""The compute dtype: which one the hardware runs natively, and the one table of dtype names.

bf16 is native on TPUs, on GPUs with bf16 tensor cores (Ampere and later), on x86 CPUs with
AVX512-BF16 or AMX-BF16 and on Arm CPUs with the BF16 extension. Everywhere else PyTorch emulates
bf16 matmuls through fp32 at a fraction of the fp32 speed, so `auto` picks fp32 there; an explicit
"bfloat16" still runs, with one warning that gives the slowdown measured on this machine.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal, TypeGuard

import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.device.peak import measure_matmul_flops
from titan_tpu.device.select import Device

logger = logging.getLogger(__name__)

# The one table from config names to dtypes (training.dtype, parallelism.fsdp_reduce_dtype,
# checkpoint.export_dtype).
DtypeName = Literal["float32", "bfloat16"]
DTYPES: dict[DtypeName, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# torch.cpu.get_capabilities() keys that mean bf16 matmul instructions: x86 AVX512-BF16 (VDPBF16PS)
# and AMX tiles; on arm64 "bf16" (FEAT_BF16: BFDOT, BFMMLA) and "sve_bf16".
_CPU_BF16_CAPABILITIES = ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """The dtype a config value names; `where` is the key, for the error."""
    if not _is_dtype_name(name):
        raise ConfigError(f"{where}: got {name!r}, expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _is_dtype_name(name: str) -> TypeGuard[DtypeName]:
    return name in DTYPES


def dtype_name(dtype: torch.dtype) -> DtypeName:
    """The config name of a dtype in DTYPES (the resolved config records "auto" as what it became)."""
    return next(name for name, known in DTYPES.items() if known == dtype)


def native_bf16(device_type: str) -> bool:
    """Whether the device computes bf16 matmuls in hardware rather than by emulation."""
    if device_type == "tpu":
        return True
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(key, False) for key in _CPU_BF16_CAPABILITIES)


def resolve_compute_dtype(requested: str, device: Device) -> torch.dtype:
    """The dtype the run computes in: "auto" is bf16 where it is native, else fp32.

    On TPU, float32 matmuls run as one bf16 pass unless asked otherwise, so a float32 run there
    sets PyTorch's float32 matmul precision to "highest" (torch_tpu maps it to its full-precision
    mode): float32 then means float32, as it does on the CPU by default.
    """
    if requested == "auto":
        dtype = torch.bfloat16 if native_bf16(device.type) else torch.float32
    else:
        dtype = dtype_from_name(requested, "training.dtype")
        if dtype == torch.bfloat16 and not native_bf16(device.type):
            _warn_emulated_bf16(device)
    if dtype == torch.float32 and device.type == "tpu":
        torch.set_float32_matmul_precision("highest")
    return dtype


@functools.cache
def _warn_emulated_bf16(device: Device) -> None:
    # A short measurement (about a second) so the warning states what this machine loses.
    size, windows, seconds = 512, 3, 0.1
    fp32 = measure_matmul_flops(torch.float32, device.torch_device, size, windows, seconds)
    bf16 = measure_matmul_flops(torch.bfloat16, device.torch_device, size, windows, seconds)
    logger.warning(
        "training.dtype = 'bfloat16' on %s, which emulates bf16: a %dx%d bf16 matmul ran %.1fx slower "
        "than float32 here (%.1f vs %.1f GFLOP/s); 'auto' picks float32 on this hardware",
        device.name(),
        size,
        size,
        fp32 / bf16,
        bf16 / 1e9,
        fp32 / 1e9,
    )
