"""The one fixed order in which a model built on `meta` is parallelised and materialised:

    TP/SP (the model's own plan) -> activation checkpointing -> torch.compile -> FSDP
    -> to_empty(device) -> init_weights() under sharding-invariant random init

so no rank ever holds the whole model, and the weights are the same whatever the layout.

The sharding-invariant random init lives in `sharded_init.py`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_tpu.distributed.compile import apply_compile, resolve_backend
from titan_tpu.distributed.fsdp import DTYPES, apply_fsdp
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.distributed.sharded_init import init_weights

# Attributes under which model families keep their repeated blocks (ModuleDict or ModuleList).
BLOCK_CONTAINERS = ("layers", "double_blocks", "single_blocks", "blocks")


def block_containers(model: nn.Module) -> list[nn.ModuleDict | nn.ModuleList]:
    """The containers of repeated blocks: the units of activation checkpointing, compile and FSDP."""
    containers = (getattr(model, name, None) for name in BLOCK_CONTAINERS)
    return [c for c in containers if isinstance(c, (nn.ModuleDict, nn.ModuleList))]


def blocks(model: nn.Module) -> list[nn.Module]:
    return [block for container in block_containers(model) for block in container.children()]


def parallelize_model(
    model: nn.Module,
    parallelize_fn: Any,
    ctx: ParallelContext,
    config: TrainConfig,
    device: torch.device,
    device_type: str,
    compute_dtype: torch.dtype,
) -> nn.Module:
    """Apply the fixed order to `model` (on meta) and return it materialised and initialised."""
    dims = ctx.dims
    if dims.tp_enabled or dims.ep_enabled:
        if parallelize_fn is None:
            raise ConfigError(
                f"model '{config.model.name}' has no tensor/expert-parallel plan; set parallelism.tp = 1 "
                "and parallelism.ep = 1"
            )
        model = parallelize_fn(model, ctx) or model
    containers = block_containers(model)
    apply_activation_checkpointing(containers, config.activation_checkpoint)
    if config.compile.enable:
        apply_compile(containers, resolve_backend(config.compile.backend, device_type))
    parallelism = config.parallelism
    offload = parallelism.fsdp_cpu_offload and dims.fsdp_enabled
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            blocks(model),
            ctx.fsdp_mesh,
            param_dtype=compute_dtype,
            reduce_dtype=DTYPES[parallelism.fsdp_reduce_dtype] if compute_dtype != torch.float32 else torch.float32,
            reshard_policy=parallelism.fsdp_reshard_after_forward,
            cpu_offload=offload,
            pin_memory=device_type != "cpu",
        )
    model.to_empty(device=torch.device("cpu") if offload else device)
    init_weights(model, config.training.seed, buffer_device=device)
    model.train()
    return model
