"""The one fixed order in which a model built on `meta` is parallelised and materialised:

    TP/SP (the model's own plan, then LoRA factors placed like the weights they adapt)
    -> activation checkpointing -> torch.compile -> activation offload -> FSDP
    -> to_empty(device) -> init_weights() under sharding-invariant random init

so no rank ever holds the whole model, and the weights are the same whatever the layout.

The sharding-invariant random init lives in `sharded_init.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.distributed.activation_checkpoint import apply_activation_checkpointing
from titan_tpu.distributed.activation_offload import apply_activation_offload
from titan_tpu.distributed.compile import apply_compile, resolve_backend
from titan_tpu.distributed.fsdp import FSDPPolicy, apply_fsdp
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.distributed.sharded_init import init_weights
from titan_tpu.lora.placement import place_factors

# Attributes under which model families keep their repeated blocks (ModuleDict or ModuleList).
BLOCK_CONTAINERS = ("layers", "double_blocks", "single_blocks", "blocks")


def block_containers(model: nn.Module) -> list[nn.ModuleDict | nn.ModuleList]:
    """The containers of repeated blocks: the units of activation checkpointing, compile and FSDP.
    A model whose blocks lie deeper (the hf family's, inside transformers' model) names them with a
    `block_containers()` method."""
    own = getattr(model, "block_containers", None)
    if callable(own):
        return list(own())
    containers = (getattr(model, name, None) for name in BLOCK_CONTAINERS)
    return [c for c in containers if isinstance(c, (nn.ModuleDict, nn.ModuleList))]


def blocks(model: nn.Module) -> list[nn.Module]:
    return [block for container in block_containers(model) for block in container.children()]


def reshard_setting(
    model: nn.Module, config: TrainConfig, compute_dtype: torch.dtype, device_type: str
) -> Callable[[nn.Module], bool]:
    """The reshard-after-forward setting each FSDP group of `model` was built with here, for code
    that holds the groups gathered for a while and then gives the setting back (generation)."""
    policy = FSDPPolicy.from_config(config.parallelism, compute_dtype, device_type, True)
    model_blocks = blocks(model)
    last_block = model_blocks[-1] if model_blocks else None

    def setting(group: nn.Module) -> bool:
        return policy.reshard_after_forward(is_last_block=group is last_block or group is model)

    return setting


def parallelize_model(
    model: nn.Module,
    parallelize_fn: Any,
    ctx: ParallelContext,
    config: TrainConfig,
    device: torch.device,
    compute_dtype: torch.dtype,
) -> nn.Module:
    """Apply the fixed order to `model` (on meta) and return it materialised and initialised on
    `device`, whose type also picks the compile backend and whether FSDP's offload pins memory.

    In a distributed run the model's `parallelize_fn` is always called, also without tp or ep: it may
    need the data-parallel mesh (Qwen 3 MoE balances its experts over the global batch)."""
    dims = ctx.dims
    # The one FSDP policy of the run, for the blocks and root here and for any FSDP groups the model's
    # own plan creates (the experts under expert parallelism).
    fsdp = FSDPPolicy.from_config(config.parallelism, compute_dtype, device.type, sharded=dims.fsdp_enabled)
    ctx = dataclasses.replace(ctx, fsdp=fsdp)
    if dims.is_distributed:
        trained = {name: param.requires_grad for name, param in model.named_parameters()}
        if parallelize_fn is not None:
            model = parallelize_fn(model, ctx) or model
        elif dims.tp_enabled or dims.ep_enabled:
            raise ConfigError(
                f"model '{config.model.name}' has no tensor/expert-parallel plan; set parallelism.tp = 1 "
                "and parallelism.ep = 1"
            )
        # Some of torch's styles (SequenceParallel) re-wrap parameters as trainable: a frozen base (LoRA)
        # stays frozen.
        for name, param in model.named_parameters():
            param.requires_grad_(trained.get(name, param.requires_grad))
        # A LoRA run's adapters (titan_tpu/lora/apply.py, swapped in on meta before this): torch's
        # styles shard them like weights, or replicate them; placed now to follow their weights.
        place_factors(model)
    containers = block_containers(model)
    apply_activation_checkpointing(containers, config.activation_checkpoint)
    if config.compile.enable:
        apply_compile(containers, resolve_backend(config.compile.backend, device.type))
    if config.activation_checkpoint.offload:
        # On the (compiled) blocks as they now stand, so the hooks run eagerly around them.
        apply_activation_offload(containers, config.activation_checkpoint.wraps_block)
    if dims.fsdp_enabled:
        apply_fsdp(model, blocks(model), ctx.fsdp_mesh, ctx.fsdp)
    # Offloaded state lives in host memory; on `meta` (the dry run) it stays on meta like the rest.
    offloaded = ctx.fsdp.cpu_offload and device.type != "meta"
    model.to_empty(device=torch.device("cpu") if offloaded else device)
    init_weights(model, config.training.seed, buffer_device=device)
    model.train()
    return model
