"""The frozen reference model of preference training and of GRPO's KL term: the model the run started
from, however far the policy has moved.

- Without LoRA, a second model built like the policy (the same arguments, so the kernels the trainer
  measured; the same layout through the fixed parallelisation order) and given the run's initial
  weights: checkpoint.initial_load_path when set, else the seeded initialisation the policy itself
  started from (sharded_init draws the same weights for the same seed on every layout). That is TRL's
  reference when none is given, a copy of the initial policy; a resumed run rebuilds the same one. It
  is in eval mode: a reference never drops out (TRL prepares its reference for evaluation too).
- With LoRA (the policy holds `LoRALinear` layers), no copy: the policy with every adapter switched
  off (`adapters_disabled`) is the base it started from, as TRL does with a PEFT model. That holds
  only while the adapters are all that trains: a run that also trains any other parameter is refused,
  since switching the adapters off would not give back the initial model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import ConfigError
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.lora.placement import FACTORS
from titan_tpu.models.common.lora import lora_layers
from titan_tpu.tasks.base import TaskContext


def trained_beside_adapters(policy: nn.Module) -> list[str]:
    """Names of the trainable parameters of `policy` that are not LoRA adapters."""
    return [
        name
        for name, param in policy.named_parameters()
        if param.requires_grad and name.rsplit(".", 1)[-1] not in FACTORS
    ]


def initial_model_reference(policy: nn.Module, ctx: TaskContext, args: Any, who: str) -> nn.Module | None:
    """The reference for `policy` (built with the family's `args`): a frozen copy of the initial model,
    or None when the policy with its adapters switched off is that model (see the module's docstring).
    `who` starts the refusal's line (the setting that asks for a reference)."""
    if any(True for _ in lora_layers(policy)):
        beside = trained_beside_adapters(policy)
        if beside:
            raise ConfigError(
                f"{who} with LoRA: {len(beside)} parameter(s) besides the adapters are trained ({beside[0]}, ...); "
                "the reference is the policy with its adapters switched off, which is the initial model only when "
                "the adapters alone train; freeze them"
            )
        return None
    return frozen_initial_copy(ctx, args)


def frozen_initial_copy(ctx: TaskContext, args: Any) -> nn.Module:
    """A frozen copy of the run's initial model in the policy's layout, in eval mode."""
    config = ctx.config
    with torch.device("meta"):
        reference = ctx.spec.model_cls(args)
    reference = parallelize_model(reference, ctx.spec.parallelize, ctx.parallel, config, ctx.device, ctx.compute_dtype)
    if config.checkpoint.initial_load_path:
        what = f"reference model {config.model.name} flavor {config.model.flavor}"
        load_hf_weights(reference, config.checkpoint.initial_load_path, ctx.spec.state_dict_adapter, args, what=what)
    return reference.requires_grad_(False).eval()
