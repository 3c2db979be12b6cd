"""What the launcher asks the hardware: how many processes a host runs, and TorchTPU's launch variables.

Both run in the launcher, before any worker starts, and neither may claim a device: the count comes
from `torch.accelerator.device_count()`, which TorchTPU answers from the PCI bus without starting
its runtime, and `set_tpu_launch_env` only writes environment variables that the workers inherit.
"""

from __future__ import annotations

import torch

from titan_tpu.device import accelerator_type, torch_tpu_function
from titan_tpu.device.tpu_runtime import skip_tpu_metadata_lookup_without_chips
from titan_tpu.launch.environment import HostPlacement


def visible_accelerator() -> str | None:
    """The accelerator this host's workers will drive ("tpu", "cuda"), or None on a CPU host."""
    skip_tpu_metadata_lookup_without_chips()  # before the first device query starts libtpu
    return accelerator_type()


def processes_per_host(accelerator: str | None) -> int:
    """One process per accelerator device: per TPU device as TorchTPU counts them (a chip, or half of
    a v7 chip, which shows two devices) or per GPU; a CPU host trains in one process."""
    if accelerator is None:
        return 1
    return torch.accelerator.device_count()


def set_tpu_launch_env(placement: HostPlacement, nproc_per_node: int) -> None:
    """TorchTPU's per-job variables (slice-builder addresses, topology, profiling session), derived by
    TorchTPU itself from the same GKE variables. It checks `nnodes` against TPU_WORKER_HOSTNAMES,
    which lists the hosts of this slice, so it gets the slice's host count; the slices of a
    multislice job are joined over the data-centre network by the MEGASCALE variables instead."""
    launch_env = torch_tpu_function("torch.tpu.distributed.set_tpu_launch_env")
    launch_env(nnodes=placement.hosts_per_slice, nproc_per_node=nproc_per_node)
