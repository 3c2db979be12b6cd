"""LoRA on a model built on `meta`, before it is parallelised: every linear `lora.target_modules` names
becomes a `LoRALinear` holding the same weight and bias, and every parameter but the adapters' is
frozen. Done first, so the tensor-parallel plan, activation checkpointing, compile and FSDP see the
adapted layers as the nn.Linear they are; the factors are then placed on the mesh (placement.py) and
initialised with the rest (titan_tpu/distributed/sharded_init.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from titan_tpu.config.sections import LoRAConfig
from titan_tpu.lora.targets import select_targets
from titan_tpu.models.common.lora import LoRALinear


def apply_lora(
    model: nn.Module,
    cfg: LoRAConfig,
    containers: Iterable[nn.Module],
    what: str,
    base_dtype: torch.dtype | None = None,
) -> list[str]:
    """Swap the targeted linears of `model` (whose repeated blocks are `containers`) for LoRALinear and
    freeze everything else; returns the adapted modules' qualified names. `what` names the model in
    messages.

    `base_dtype` (the trainer gives the run's compute dtype): the adapted linears' frozen weight and
    bias are stored in it. Every forward computes them in that dtype anyway (autocast, or FSDP's
    mixed precision casts each parameter to it), and a frozen weight never takes an update that a
    float32 master copy would keep, so storing the cast once gives the same numbers as casting the
    float32 weight at each forward, in half the memory under bf16, as PEFT users load a base in bf16.
    The other frozen parameters (embeddings, norms, head) stay float32: a single device's autocast
    does not cast them, and storing them lower would change its numbers."""
    targets = select_targets(model, containers, cfg.target_modules, what)
    model.requires_grad_(False)
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        adapted = LoRALinear.wrapping(linear, rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout)
        if base_dtype is not None:
            store_frozen_in(adapted, base_dtype)
        setattr(parent, child, adapted)
    return targets


def store_frozen_in(layer: LoRALinear, dtype: torch.dtype) -> None:
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        if param is not None and param.dtype != dtype:
            setattr(layer, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))
