"""FSDP2 (`fully_shard`) per transformer block and on the whole model; HSDP on a 2-D mesh.

`FSDPPolicy` is the run's one answer to "in which dtypes, when resharded, where stored": every
`fully_shard` call (blocks, root, and the experts' own groups under expert parallelism) takes it from
`ParallelContext.fsdp`, which `parallelize_model` builds from the config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import ParallelismConfig
from titan_tpu.device.dtype import dtype_from_name

RESHARD_POLICIES = ("default", "always", "never")


@dataclass(frozen=True)
class FSDPPolicy:
    """Mixed precision, resharding and offload for every FSDP group of a run.

    Parameters are stored in float32 and gathered in `param_dtype` for compute; gradients are
    reduced in `reduce_dtype`. `reshard`: "default" frees gathered parameters after forward except in
    the last block, whose backward starts right away; "always" / "never" as named. The default
    instance is a float32 run without offload.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    reshard: str = "default"
    cpu_offload: bool = False
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.reshard not in RESHARD_POLICIES:
            raise ConfigError(
                f"parallelism.fsdp_reshard_after_forward: got {self.reshard!r}, expected "
                f"{', '.join(RESHARD_POLICIES[:-1])} or {RESHARD_POLICIES[-1]}"
            )

    @classmethod
    def from_config(
        cls, cfg: ParallelismConfig, compute_dtype: torch.dtype, device_type: str, sharded: bool
    ) -> FSDPPolicy:
        """`[parallelism]` fsdp_* keys and the compute dtype; with float32 compute everything stays
        float32 (a bf16 reduction of float32 gradients would only lose precision). Offload applies
        only when FSDP does (`sharded`): an unsharded model is never parked on the host."""
        return cls(
            param_dtype=compute_dtype,
            reduce_dtype=dtype_from_name(cfg.fsdp_reduce_dtype, "parallelism.fsdp_reduce_dtype")
            if compute_dtype != torch.float32
            else torch.float32,
            reshard=cfg.fsdp_reshard_after_forward,
            cpu_offload=cfg.fsdp_cpu_offload and sharded,
            # Pinned host memory speeds up copies to an accelerator; a CPU run has nothing to copy, and
            # a model set up on `meta` (the dry run, titan_tpu/dryrun) has no host memory to pin.
            pin_memory=device_type not in ("cpu", "meta"),
        )

    def reshard_after_forward(self, is_last_block: bool) -> bool:
        if self.reshard == "default":
            return not is_last_block
        return self.reshard == "always"

    def shard_kwargs(self, is_last_block: bool) -> dict[str, Any]:
        """Keyword arguments of `fully_shard` for one group (a block, or the experts of one block)."""
        offload = CPUOffloadPolicy(pin_memory=self.pin_memory) if self.cpu_offload else OffloadPolicy()
        return {
            "reshard_after_forward": self.reshard_after_forward(is_last_block),
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype),
            "offload_policy": offload,
        }


def apply_fsdp(model: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh, policy: FSDPPolicy) -> None:
    """Shard each block (one all-gather / reduce-scatter per block), then the root, which takes the
    remaining parameters (embeddings, final norm, head). A 2-D mesh (dp_replicate, dp_shard) gives
    HSDP: sharded within a replica group, gradients all-reduced across groups."""
    for index, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, **policy.shard_kwargs(is_last_block=index == len(blocks) - 1))
    # The root's parameters are needed first in backward (the head): like the last block, they stay
    # gathered unless the policy says always.
    fully_shard(model, mesh=mesh, **policy.shard_kwargs(is_last_block=True))


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP group's gathered parameters after a forward that no backward follows (held-out
    loss, log-probabilities scored for a rollout): FSDP keeps the last block and the root gathered for
    the backward training would run next; left so, the model would hold unsharded parameters that the
    optimizer and a checkpoint do not know. A model without FSDP is left as it is."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
