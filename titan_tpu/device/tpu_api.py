"""Every function titan_tpu calls from the `torch_tpu` package, by its public path.

`torch_tpu` publishes its API under `torch.tpu` (the table in its `public_api` module); functions
that `torch.accelerator` covers (device_count, is_available, set_device, synchronize, ...) are
internal there and raise when called from outside PyTorch, so they are not listed. The keyword
arguments beside each path are the ones the project passes; the `tpu` test group checks each path
and keyword against the installed package, and checks that project code names no other
`torch.tpu` function, so a rename in a new release fails a test instead of a TPU run.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

TPU_INSTALL_HINT = "pip install -e '.[tpu]'"

TORCH_TPU_CALLS: dict[str, tuple[str, ...]] = {
    # Device name (generation) and per-device HBM; `Device.name` / `memory_capacity_gib`.
    "torch.tpu.get_device_name": ("device",),
    "torch.tpu.get_device_properties": ("device",),
    # The Pallas splash attention kernel; titan_tpu/models/common/attention_kernels.py `SplashAttention`.
    "torch.tpu.ops.splash_sdpa": (
        "scale",
        "is_causal",
        "enable_gqa",
        "block_q",
        "block_kv",
        "block_kv_compute",
        "block_dkv",
        "block_kv_dkv_compute",
    ),
    # The MoE experts' grouped matmul over ragged runs, differentiable in lhs and rhs (so its weight
    # gradient op is not called); titan_tpu/models/qwen3/moe.py `_ragged_dot`.
    "torch.tpu.ops.ragged_dot": ("lhs", "rhs", "group_sizes"),
    # Expert parallelism's token exchange, differentiable in operand;
    # titan_tpu/distributed/ragged_exchange.py.
    "torch.tpu.ops.ragged_all_to_all": (
        "operand",
        "output",
        "input_offsets",
        "send_sizes",
        "output_offsets",
        "recv_sizes",
        "process_group_name",
    ),
    # Rank layout of the device mesh on the chips' interconnect (dp_replicate over DCN).
    "torch.tpu.distributed.topology_aware_mesh": ("mesh_shape", "dcn_mesh_shape", "allow_split_physical_axes"),
    # Device-trace options of torch.profiler on TPU (a class); titan_tpu/device/tracing.py.
    "torch.tpu.profiler.TpuProfilerConfig": ("run_dir", "worker_rank"),
    # The launcher's per-host environment for multi-host jobs.
    "torch.tpu.distributed.set_tpu_launch_env": ("nnodes", "nproc_per_node"),
}


@functools.cache
def torch_tpu_function(path: str) -> Callable[..., Any]:
    """The public torch_tpu function at `path` (a key of TORCH_TPU_CALLS), e.g.
    `torch_tpu_function("torch.tpu.ops.splash_sdpa")`. Needs torch_tpu installed."""
    if path not in TORCH_TPU_CALLS:
        raise KeyError(f"{path} is not in TORCH_TPU_CALLS; add it there (with its keywords) before calling it")
    # `torch.tpu` exists once torch_tpu is imported; `import torch` does that only where the backend
    # autoload ran (not on hosts without TPU device files, see tpu_runtime).
    importlib.import_module("torch_tpu")
    module_path, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module_path), name)
