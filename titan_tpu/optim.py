"""AdamW with decoupled weight decay on matrices only, and a warmup-then-decay schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from titan_tpu.config.sections import LRSchedulerConfig, OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    # Norm gains (1-D) are not decayed: pulling them toward zero only fights the normalisation.
    # Embeddings are matrices and decay like every other weight, as in Llama and TorchTitan.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kernel = {
        "auto": {},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
        "for-loop": {"foreach": False},
    }[cfg.implementation]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernel
    )


def lr_multiplier(step: int, total_steps: int, cfg: LRSchedulerConfig) -> float:
    """Factor on the peak lr before optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        # Start above zero so that the first step already moves the weights.
        return (step + 1) / (cfg.warmup_steps + 1)
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.decay_type == "constant":
        return 1.0
    if cfg.decay_type == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))
