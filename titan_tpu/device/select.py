"""Which device this process trains on, and the few operations the rest of the code needs from it.

Detection, device count, set-device, synchronisation and memory statistics go through PyTorch's
device-generic `torch.accelerator` API. That is the supported way into TPUs: the `torch_tpu`
package (PyPI `torch-tpu`) is loaded by `import torch` through torch's backend entry point and, on a
host with chips, renames PrivateUse1 to "tpu", registers `torch.tpu` and the process-group backends
"tpu" and "tpu_dist". On a host without TPU device files the entry points switch that autoload off
(`tpu_runtime`), since no chip can be seen there. Its own `torch.tpu.device_count()`, `is_available()`, `set_device()`,
`synchronize()` and `current_device()` are internal to PyTorch and raise when user code calls them.
From `torch.tpu` this module calls only `get_device_name` and `get_device_properties` (public,
marked experimental), through `torch.get_device_module`, and hands out `torch.tpu.ops.splash_sdpa` and
`torch.tpu.ops.ragged_dot`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import torch

from titan_tpu.config.errors import ConfigError
from titan_tpu.device import memory
from titan_tpu.device.tpu_api import TPU_INSTALL_HINT, torch_tpu_function
from titan_tpu.device.tpu_runtime import (
    AUTOLOAD_VARIABLE,
    TPU_DEVICE_FILES,
    host_has_tpu_device_files,
    skip_tpu_metadata_lookup_without_chips,
)

logger = logging.getLogger(__name__)

DeviceType = Literal["tpu", "cuda", "cpu"]

# Process-group backends: gloo always handles CPU tensors (object collectives, CPU-side state),
# the accelerator's own backend handles its tensors.
_BACKENDS: dict[str, str] = {
    "tpu": "cpu:gloo,tpu:tpu_dist",
    "cuda": "cpu:gloo,cuda:nccl",
    "cpu": "gloo",
}


def accelerator_type() -> str | None:
    """The accelerator PyTorch drives in this process ("tpu", "cuda", ...), or None."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return None if accelerator is None else accelerator.type


def torch_tpu_version() -> str | None:
    """The installed torch-tpu version, or None; looked up without importing the package."""
    if importlib.util.find_spec("torch_tpu") is None:
        return None
    try:
        return importlib.metadata.version("torch-tpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def _is_accelerator(name: str | None) -> TypeGuard[Literal["tpu", "cuda"]]:
    return name in ("tpu", "cuda")


def _is_device_type(name: str) -> TypeGuard[DeviceType]:
    return name in _BACKENDS


def available(device_type: DeviceType) -> bool:
    return device_type == "cpu" or accelerator_type() == device_type


def resolve_device_type(requested: str, warn: bool = True) -> DeviceType:
    """`auto` picks the accelerator PyTorch sees (tpu or cuda), else the CPU; a forced type must be
    there. `warn`: say why an installed accelerator package is not used (once per host, not per
    process)."""
    skip_tpu_metadata_lookup_without_chips()  # before the first device query starts libtpu
    if requested == "auto":
        found = accelerator_type()
        if _is_accelerator(found):
            return found
        if not warn:
            return "cpu"
        if found is not None:
            logger.warning("device: torch.accelerator reports %r, which titan_tpu does not drive; using the CPU", found)
        elif torch_tpu_version() is not None:
            logger.warning("device: %s; using the CPU", _why_no_tpu())
        return "cpu"
    if not _is_device_type(requested):
        raise ConfigError(f"device.type: got {requested!r}, expected one of auto, tpu, cuda, cpu")
    if not available(requested):
        reason = _why_missing(requested)
        raise ConfigError(f"device.type = '{requested}' was requested but {reason}; use 'auto' or 'cpu'")
    return requested


def _why_missing(device_type: str) -> str:
    if device_type == "cuda":
        return "torch.accelerator sees no GPU (is this a CPU build of PyTorch?)"
    return _why_no_tpu()


def _why_no_tpu() -> str:
    version = torch_tpu_version()
    if version is None:
        return f"the torch_tpu package is not installed ({TPU_INSTALL_HINT})"
    if not host_has_tpu_device_files():
        files = ", ".join(TPU_DEVICE_FILES)
        return f"torch_tpu {version} is installed but this host has no TPU device files ({files})"
    autoload = os.environ.get(AUTOLOAD_VARIABLE, "1")
    if autoload != "1":  # torch loads backends only when it is exactly "1"
        return f"{AUTOLOAD_VARIABLE}={autoload} kept torch_tpu {version} from loading with torch; unset it"
    return f"torch_tpu {version} sees no TPU chip on this host (torch.accelerator reports none)"


def process_group_backend(device_type: DeviceType) -> str:
    return _BACKENDS[device_type]


@dataclass(frozen=True)
class Device:
    """The device this process trains on, and the operations the rest of the code needs from it."""

    type: DeviceType
    index: int

    @property
    def torch_device(self) -> torch.device:
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, self.index)

    @property
    def backend(self) -> str:
        return process_group_backend(self.type)

    def activate(self) -> None:
        """Make this device the current one for the process (one accelerator per process)."""
        if self.type == "cpu":
            return
        count = torch.accelerator.device_count()
        if self.index >= count:
            raise ConfigError(
                f"device: local rank {self.index} needs {self.type} device {self.index}, but this host has "
                f"{count}; start at most {count} processes per host (torchrun --nproc-per-node={count})"
            )
        torch.accelerator.set_device_index(self.index)

    def synchronize(self) -> None:
        if self.type != "cpu":
            torch.accelerator.synchronize(self.index)

    def name(self) -> str:
        """The device's name as its runtime reports it ("TPU v6e", "NVIDIA H200", the CPU model);
        the peak-FLOP/s table is looked up by it."""
        if self.type == "cpu":
            return str(torch.cpu.get_capabilities().get("cpu_name") or "cpu")
        return str(torch.get_device_module(self.type).get_device_name(self.index))

    def memory_capacity_gib(self) -> float | None:
        """Memory one device can address (HBM per device on TPU: half a v7 chip's); None on CPU."""
        if self.type == "cpu":
            return None
        return torch.get_device_module(self.type).get_device_properties(self.index).total_memory / 2**30

    def splash_attention_op(self) -> Callable[..., Any] | None:
        """TorchTPU's Pallas splash attention (`torch.tpu.ops.splash_sdpa`) on TPU when jax (which
        the kernel imports) is installed, else None."""
        if self.type != "tpu" or importlib.util.find_spec("jax") is None:
            return None
        return torch_tpu_function("torch.tpu.ops.splash_sdpa")

    def ragged_dot_op(self) -> Callable[..., Any] | None:
        """TorchTPU's ragged grouped matmul (`torch.tpu.ops.ragged_dot`, the MoE experts' matmul
        without padding) on TPU, else None."""
        return torch_tpu_function("torch.tpu.ops.ragged_dot") if self.type == "tpu" else None

    def reset_peak_memory(self) -> None:
        """Start a new window for `peak_memory_gib`."""
        if self.type == "cpu":
            memory.reset_peak_rss()
        else:
            torch.accelerator.reset_peak_memory_stats(self.index)

    def peak_memory_gib(self) -> float:
        """Peak memory since the last `reset_peak_memory`: tensors allocated on an accelerator, the
        process's resident set on the CPU."""
        if self.type == "cpu":
            return memory.peak_rss_gib()
        return torch.accelerator.max_memory_allocated(self.index) / 2**30


def select_device(requested: str, local_rank: int) -> Device:
    device = Device(resolve_device_type(requested, warn=local_rank == 0), local_rank)
    device.activate()
    return device
