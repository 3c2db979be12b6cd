"""AdamW with decoupled weight decay on matrices only, and a warmup-then-decay schedule.

On TPU this is still `torch.optim.AdamW`, not `torch.tpu.optimizers.AdamW`. TorchTPU's AdamW is a
stateless functional optimizer for its `SingleTraceTrainer` (`init_param_group` / `step(param_group,
grads)`): it has no param groups (no per-group weight decay), no `state_dict` for distributed
checkpoints, its lr is fixed when it is built (so no lr schedule), it keeps the moments in bf16 by
default, and it is marked experimental; its step calls `torch.optim.adamw.adamw`, the same function
`torch.optim.AdamW` runs, so nothing is lost by using the standard class. What is taken from it is
its default `capturable=True` on TPU: step counts and bias corrections are device tensors, not
Python numbers that change every step (not yet measured on a chip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titan_tpu.config.sections import LRSchedulerConfig, OptimizerConfig

ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each the parameter's shape and dtype
STEP_COUNT_BYTES = 4  # AdamW's step count: one float32 tensor per parameter

_KERNELS: dict[str, dict[str, bool]] = {
    "auto": {},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}


def adamw_options(cfg: OptimizerConfig, device_type: str) -> dict[str, Any]:
    """Keyword arguments of `torch.optim.AdamW` for parameters on `device_type`."""
    options: dict[str, Any] = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps}
    options.update(_KERNELS[cfg.implementation])
    if device_type == "tpu":
        options["capturable"] = True
    return options


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters, which are already on their device."""
    # Norm gains (1-D) are not decayed: pulling them toward zero only fights the normalisation.
    # Embeddings are matrices and decay like every other weight, as in Llama and TorchTitan.
    # A LoRA run trains only the adapters' factors, all matrices, decayed as PEFT and TRL decay them.
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            (decay if decays(param) else no_decay).append(param)
    # An empty group is left out (a LoRA run has no undecayed parameter): the flattened optimizer
    # state of a checkpoint names each group by its first parameter.
    groups = [
        {"params": params, "weight_decay": weight_decay}
        for params, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if params
    ]
    device_type = next((param.device.type for param in decay + no_decay), "cpu")
    return torch.optim.AdamW(groups, **adamw_options(cfg, device_type))


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies to `param`: matrices (and larger) do, norm gains and biases not."""
    return param.ndim >= 2


def adamw_state_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes AdamW's state takes on this process for `params` once it has stepped: two moments of each
    parameter's local elements (a DTensor's shard) in its dtype, and a float32 step count per tensor."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    return sum(ADAM_MOMENTS * t.numel() * t.element_size() + STEP_COUNT_BYTES for t in local)


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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))


def apply_config_on_resume(
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    cfg: OptimizerConfig,
    schedule: LRSchedulerConfig,
    total_steps: int,
) -> None:
    """After a checkpoint was loaded: the run's own hyperparameters over the ones the checkpoint
    restored, so a restart with another peak lr, betas, weight decay, schedule or step count trains
    with them from the resumed step on (the moments, the step and the schedule's position stay the
    checkpoint's). Loading restores the saving run's values into the param groups and the schedule's
    base lr; left there, a changed `optimizer.lr` would be accepted and never used."""
    for group in optimizer.param_groups:
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        # build_optimizer's groups: the decayed matrices, the undecayed norms and biases.
        group["weight_decay"] = cfg.weight_decay if decays(group["params"][0]) else 0.0
        group["initial_lr"] = cfg.lr
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    # The lr of the next step, as the schedule sets it after `last_epoch` steps (its lambda is built
    # from this run's config; a checkpoint does not save functions).
    factor = lr_multiplier(scheduler.last_epoch, total_steps, schedule)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * factor
