"""The one place that names device types.

Everything else asks this module for the device, the process-group backend, synchronisation, memory
statistics and the device's name (from which the metrics look up the peak FLOP/s).

TPUs are reached through the native PyTorch TPU backend: the `torch_tpu` package registers a
PrivateUse1 device named "tpu" and a process-group backend "tpu_dist". It is optional: on machines
without it the same code runs on cuda or the CPU.
"""

from __future__ import annotations

import importlib
import resource
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from titan_tpu.config.errors import ConfigError

DeviceType = Literal["tpu", "cuda", "cpu"]

# Process-group backends: gloo always handles CPU tensors (object collectives, CPU-side state),
# the accelerator's own backend handles its tensors.
_BACKENDS: dict[str, str] = {
    "tpu": "cpu:gloo,tpu:tpu_dist",
    "cuda": "cpu:gloo,cuda:nccl",
    "cpu": "gloo",
}


def _tpu_module() -> ModuleType | None:
    """The torch_tpu device module if the package imports and sees at least one chip."""
    try:
        torch_tpu = importlib.import_module("torch_tpu")
    except ImportError:
        return None
    # torch_tpu registers itself as torch's "tpu" device module; prefer that handle when present.
    try:
        module = torch.get_device_module("tpu")
    except (RuntimeError, AttributeError):
        module = torch_tpu
    return module if module.device_count() > 0 else None


def _device_module(device_type: DeviceType) -> ModuleType | None:
    if device_type == "tpu":
        return _tpu_module()
    if device_type == "cuda":
        return torch.cuda
    return None


def available(device_type: DeviceType) -> bool:
    if device_type == "tpu":
        return _tpu_module() is not None
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    return True


def resolve_device_type(requested: str) -> DeviceType:
    """`auto` picks tpu, then cuda, then cpu; a forced type must actually be there."""
    if requested == "auto":
        for candidate in ("tpu", "cuda"):
            if available(candidate):
                return candidate
        return "cpu"
    if requested not in _BACKENDS:
        raise ConfigError(f"device.type: got {requested!r}, expected one of auto, tpu, cuda, cpu")
    if not available(requested):  # type: ignore[arg-type]
        hint = {
            "tpu": "the torch_tpu package is not importable or sees no TPU chips",
            "cuda": "torch.cuda sees no GPU (is this a CPU build of PyTorch?)",
        }[requested]
        raise ConfigError(f"device.type = '{requested}' was requested but {hint}; use 'auto' or 'cpu'")
    return requested  # type: ignore[return-value]


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
        module = _device_module(self.type)
        if module is not None:
            module.set_device(self.index)

    def synchronize(self) -> None:
        module = _device_module(self.type)
        if module is not None:
            module.synchronize(self.index)

    def name(self) -> str:
        """Human-readable device name used for the peak-FLOP/s lookup ("NVIDIA H200", "TPU v5p")."""
        module = _device_module(self.type)
        if module is not None:
            return str(module.get_device_name(self.index))
        return "cpu"

    def peak_memory_gib(self) -> float:
        """Peak memory allocated on the device since start-up; on the CPU, the process's peak RSS."""
        module = _device_module(self.type)
        if module is not None:
            return module.max_memory_allocated(self.index) / 2**30
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in KiB on Linux and in bytes on macOS.
        return kib / (2**30 if sys.platform == "darwin" else 2**20)

    def attention_block(self) -> int:
        """Query-block size for blocked causal attention, or 0 for the fused SDPA kernels.

        CPUs run SDPA's flash kernel far below their matmul speed in bf16 (a 100M model spends a
        quarter of its step there); blocked attention in plain matmuls is 1.15x faster per step.
        Accelerators have fused attention kernels that beat plain matmuls.
        """
        return 128 if self.type == "cpu" else 0

    def supports_bfloat16(self) -> bool:
        if self.type == "cuda":
            return torch.cuda.is_bf16_supported()
        return True  # TPUs and CPUs compute in bf16 natively


def select_device(requested: str, local_rank: int) -> Device:
    device = Device(resolve_device_type(requested), local_rank)
    device.activate()
    return device
