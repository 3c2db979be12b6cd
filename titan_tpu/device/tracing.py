"""What `torch.profiler` needs to know about each device type: which activities to record, the TPU's
trace options, and the CUDA allocator's memory snapshot (the step profiler is metrics/profiler.py).

- CPU: host activities only; the Chrome trace holds every op.
- CUDA: host and CUDA kernels; with memory, the caching allocator records its history and dumps a
  snapshot (a pickle that pytorch.org/memory_viz opens).
- TPU: host activities and the backend's (PrivateUse1), with torch_tpu's public profiler options
  (`torch.tpu.profiler.TpuProfilerConfig`), which write the device trace (XPlane, opened in
  TensorBoard's profile plugin or XProf) to the trace folder beside the host's Chrome trace.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from titan_tpu.device.select import DeviceType
from titan_tpu.device.tpu_api import torch_tpu_function

# Allocation events the CUDA allocator keeps for its snapshot (its documented example's size).
CUDA_MEMORY_EVENTS = 100_000


def profiler_activities(device_type: DeviceType) -> list[ProfilerActivity]:
    accelerator = {"cuda": [ProfilerActivity.CUDA], "tpu": [ProfilerActivity.PrivateUse1]}
    return [ProfilerActivity.CPU, *accelerator.get(device_type, [])]


def profiler_options(device_type: DeviceType, folder: Path, rank: int) -> torch.profiler._ExperimentalConfig | None:
    """The device's own trace options, where it has some (TPU: where and under which rank its
    device trace is written)."""
    if device_type != "tpu":
        return None
    config_class = torch_tpu_function("torch.tpu.profiler.TpuProfilerConfig")
    return config_class(run_dir=str(folder), worker_rank=str(rank))


def start_memory_history(device_type: DeviceType) -> bool:
    """Start recording allocations for a snapshot where the device keeps one (CUDA); whether it does."""
    if device_type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=CUDA_MEMORY_EVENTS)
    return True


def dump_memory_history(path: Path) -> None:
    """Write the CUDA allocator's snapshot to `path` and stop recording."""
    torch.cuda.memory._dump_snapshot(str(path))
    torch.cuda.memory._record_memory_history(enabled=None)
