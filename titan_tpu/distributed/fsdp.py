"""FSDP2 (`fully_shard`) per transformer block and on the whole model; HSDP on a 2-D mesh."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_tpu.config.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reshard_after_forward(policy: str, is_last_block: bool) -> bool:
    """"default": free gathered parameters after forward except in the last block, whose backward
    starts right away; "always" / "never" as named."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        return not is_last_block
    raise ConfigError(
        f"parallelism.fsdp_reshard_after_forward: got {policy!r}, expected default, always or never"
    )


def apply_fsdp(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_policy: str,
    cpu_offload: bool,
    pin_memory: bool,
) -> None:
    """Shard each block (one all-gather / reduce-scatter per block), then the root, which takes the
    remaining parameters (embeddings, final norm, head). A 2-D mesh (dp_replicate, dp_shard) gives
    HSDP: sharded within a replica group, gradients all-reduced across groups.

    Mixed precision: parameters are stored in float32 and gathered in `param_dtype` for compute;
    gradients are reduced in `reduce_dtype`. With float32 compute everything stays float32.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    for index, block in enumerate(blocks):
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward(reshard_policy, index == len(blocks) - 1),
            mp_policy=mp_policy,
            offload_policy=offload,
        )
    # The root's parameters are needed first in backward (the head): keep them gathered unless
    # the policy says always.
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=reshard_policy == "always",
        mp_policy=mp_policy,
        offload_policy=offload,
    )
