"""Activation checkpointing: none, full (every block), or selective (every Nth block, or op-level:
keep matmul / attention outputs, recompute the cheap elementwise ops in backward)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_tpu.config.sections import ActivationCheckpointConfig

_aten = torch.ops.aten


def _ops_to_save() -> set[Any]:
    """Matmuls and attention kernels: expensive to recompute, their outputs are kept. Collectives
    (tensor parallel reductions) are kept too, so backward does not re-run communication."""
    ops: set[Any] = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default}
    for name in (
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    ):
        if hasattr(_aten, name):
            ops.add(getattr(_aten, name).default)
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None:
        for name in ("reduce_scatter_tensor", "all_reduce"):
            if hasattr(functional, name):
                ops.add(getattr(functional, name).default)
    return ops


def _save_matmuls_policy(ops: set[Any]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if func in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_level_context_fn() -> Any:
    return create_selective_checkpoint_contexts(_save_matmuls_policy(_ops_to_save()))


def wrap_block(block: nn.Module, op_level: bool) -> nn.Module:
    # No dropout in these models, so the RNG state need not be stashed and restored.
    if op_level:
        return checkpoint_wrapper(block, context_fn=op_level_context_fn, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False)


def apply_activation_checkpointing(
    containers: list[nn.ModuleDict | nn.ModuleList], cfg: ActivationCheckpointConfig
) -> int:
    """Wrap blocks in place inside their containers; returns how many were wrapped.

    selective N checkpoints blocks 0, N, 2N, ... (counted across containers): memory falls by about
    1/N of full checkpointing's saving, recompute costs 1/N of it.
    """
    wrapped = 0
    index = 0
    for container in containers:
        if isinstance(container, nn.ModuleDict):
            for name in list(container.keys()):
                if cfg.wraps_block(index):
                    container[name] = wrap_block(container[name], cfg.op_level)
                    wrapped += 1
                index += 1
        else:
            for position in range(len(container)):
                if cfg.wraps_block(index):
                    container[position] = wrap_block(container[position], cfg.op_level)
                    wrapped += 1
                index += 1
    return wrapped
