"""The frozen reference policy of preference training: the model the run started from.

- Without LoRA, a second model built like the policy (the same arguments, so the kernels the trainer
  measured; the same layout through the fixed parallelisation order) and given the run's initial
  weights: checkpoint.initial_load_path when set, else the seeded initialisation the policy itself
  started from (sharded_init draws the same weights for the same seed on every layout). That is
  TRL's reference when none is given, a copy of the initial policy; a resumed run rebuilds the same
  one, whatever the policy has become.
- With LoRA (the policy holds `LoRALinear` layers), no copy: the policy with every adapter switched
  off (`adapters_disabled`) is the base it started from, as TRL does with a PEFT model. That holds only
  while the adapters are all that trains: a run that also trains any other parameter is refused,
  since switching the adapters off would not give back the initial model.

Its log-probabilities are computed once per micro-batch, under no_grad, before the policy's forward.
Under FSDP a forward that no backward follows leaves the last block and the root gathered; they are
resharded at once.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import ConfigError
from titan_tpu.distributed.fsdp import reshard_all
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.models.common.lora import adapters_disabled, lora_layers
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.dpo.batch import PreferenceBatch, sequence_logps

ADAPTER_PARAMETERS = ("lora_A", "lora_B")


def trained_beside_adapters(policy: nn.Module) -> list[str]:
    """Names of the trainable parameters of `policy` that are not LoRA adapters."""
    return [
        name
        for name, param in policy.named_parameters()
        if param.requires_grad and name.rsplit(".", 1)[-1] not in ADAPTER_PARAMETERS
    ]


class Reference:
    """Log-probabilities of a batch's completions under the reference: `model` (a frozen copy), or the
    policy with its adapters off when `model` is None."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model

    @classmethod
    def for_policy(cls, policy: nn.Module, ctx: TaskContext) -> Reference:
        if any(True for _ in lora_layers(policy)):
            beside = trained_beside_adapters(policy)
            if beside:
                raise ConfigError(
                    f"training.task = 'dpo' with LoRA: {len(beside)} parameter(s) besides the adapters are trained "
                    f"({beside[0]}, ...); the reference is the policy with its adapters switched off, which is the "
                    "initial model only when the adapters alone train; freeze them"
                )
            return cls(None)
        return cls(build_reference(policy, ctx))

    @property
    def is_adapter_switch(self) -> bool:
        return self.model is None

    @torch.no_grad()
    def logps(self, policy: nn.Module, batch: PreferenceBatch) -> torch.Tensor:
        """[2n]: each sequence's completion log-probability under the reference."""
        if self.model is None:
            with adapters_disabled(policy):
                output = policy(batch.tokens)
            reshard_all(policy)
        else:
            output = self.model(batch.tokens)
            reshard_all(self.model)
        return sequence_logps(output, batch)


def build_reference(policy: nn.Module, ctx: TaskContext) -> nn.Module:
    """A frozen copy of the run's initial model in the policy's layout (see the module's docstring)."""
    config = ctx.config
    args = policy.args  # the family's arguments as built, with the measured kernels
    with torch.device("meta"):
        reference = ctx.spec.model_cls(args)
    reference = parallelize_model(reference, ctx.spec.parallelize, ctx.parallel, config, ctx.device, ctx.compute_dtype)
    if config.checkpoint.initial_load_path:
        what = f"reference model {config.model.name} flavor {config.model.flavor}"
        load_hf_weights(reference, config.checkpoint.initial_load_path, ctx.spec.state_dict_adapter, args, what=what)
    return reference.requires_grad_(False).eval()
