"""What host memory costs in time: FSDP CPU offload (`parallelism.fsdp_cpu_offload`) and activation
offload (`activation_checkpoint.offload`), over the host link (`chips.py`, `ChipType.host_link_bytes_per_s`).

FSDP CPU offload (FSDP2 `CPUOffloadPolicy`, titan_tpu/distributed/fsdp.py): the sharded float32
parameters, their gradients and AdamW's state live in host memory, so none of them is in HBM
(memory.py drops them; the gathered units and the activations stay). Each time FSDP gathers a unit
it first copies the unit's float32 shard host -> device (FSDP2 `FSDPParam` all-gather inputs), and
each reduce-scatter's sharded gradient goes device -> host. Both are issued on FSDP's all-gather and
reduce-scatter streams ahead of or after the collective they feed, so they overlap compute as the
collectives do: charged in the overlapped host-link term. The optimizer then steps on the host CPU
(the parameters are host tensors), between backward and the next forward: exposed, at
`HOST_ADAM_ELEMENTS_PER_S` per device.

Activation offload (titan_tpu/distributed/activation_offload.py): each checkpointed block's input
goes device -> host in forward (non-blocking, the forward goes on: overlapped) and comes back host ->
device when backward unpacks it, right before the recomputation that needs it (nothing prefetches
it: exposed).

Host memory: the offloaded state (and activation offload's inputs) must fit the host's RAM too; no
per-host RAM figure is written in chips.py (the vendors' pages list machine types with varying
memory), so the planner reports the host bytes per device and does not check them.
"""

from __future__ import annotations

from titan_tpu.plan.activations import FLOAT32
from titan_tpu.plan.chips import Cluster

# AdamW over host tensors, elements (parameters) per second per device. An assumption: torch's
# default (foreach) AdamW on host tensors ran 2.5e8 elements/s on one thread of a 2-core Xeon
# (avx512_bf16, amx_bf16) and the fused one 1.05e9 (one run each, on a machine shared with other
# work); a TPU host gives each chip about 20 cores (v6e: 180 vCPUs per 4- or 8-chip host) sharing
# DRAM bandwidth at ~28 bytes per element (read parameter, gradient, two moments; write three).
HOST_ADAM_ELEMENTS_PER_S = 1e9
# Bytes AdamW keeps per parameter element in host memory under FSDP CPU offload: float32 parameter,
# gradient and two moments.
OFFLOADED_BYTES_PER_ELEMENT = 4 * FLOAT32


def host_link_bytes_per_s(cluster: Cluster) -> float:
    """One direction, per device."""
    return cluster.chip.host_link_bytes_per_s / cluster.chip.devices_per_chip


def fsdp_offload_bytes(local_elements: int, gathers_per_step: float, reductions_per_step: int) -> tuple[float, float]:
    """(host -> device, device -> host) bytes per step of one device under FSDP CPU offload: the float32
    shard copied in for every gather of it, the float32 gradient shard copied out per reduction."""
    return FLOAT32 * local_elements * gathers_per_step, FLOAT32 * local_elements * reductions_per_step


def host_link_seconds(bytes_moved: float, cluster: Cluster) -> float:
    return bytes_moved / host_link_bytes_per_s(cluster)


def host_optimizer_seconds(local_elements: int) -> float:
    return local_elements / HOST_ADAM_ELEMENTS_PER_S
