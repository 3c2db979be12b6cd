"""The frozen reference policy of GRPO's KL term (rl.beta > 0): the model the run started from.

- Without LoRA, a second model built like the policy (the same arguments, so the kernels the trainer
  measured; the same layout through the fixed parallelisation order) with the run's initial weights:
  checkpoint.initial_load_path when set, else the seeded initialisation the policy started from. A
  resumed run rebuilds the same reference, whatever the policy has become.
- With LoRA (the policy holds `LoRALinear` layers, and [lora] freezes everything else), no copy: the
  policy with its adapters switched off is the base it started from, as TRL's GRPOTrainer does with a
  PEFT model. It costs no memory; its forward leaves FSDP's last block gathered, so the caller reshards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.distributed.parallelize import parallelize_model
from titan_tpu.generation.logprobs import token_logps
from titan_tpu.models.common.lora import adapters_disabled, lora_layers
from titan_tpu.tasks.base import TaskContext

TokenScorer = Callable[[torch.Tensor], torch.Tensor]


class KLReference:
    """Per-token log-probabilities under the reference: a frozen copy (`model`), or the policy with its
    adapters off when `model` is None."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model

    @classmethod
    def for_policy(cls, policy: nn.Module, ctx: TaskContext, args: Any) -> KLReference:
        if any(True for _ in lora_layers(policy)):
            return cls(None)
        config = ctx.config
        with torch.device("meta"):
            reference = ctx.spec.model_cls(args)
        reference = parallelize_model(
            reference, ctx.spec.parallelize, ctx.parallel, config, ctx.device, ctx.compute_dtype
        )
        if config.checkpoint.initial_load_path:
            what = f"reference model {config.model.name} flavor {config.model.flavor}"
            load_hf_weights(
                reference, config.checkpoint.initial_load_path, ctx.spec.state_dict_adapter, args, what=what
            )
        return cls(reference.requires_grad_(False))

    @property
    def is_adapter_switch(self) -> bool:
        """The policy's own modules score the reference (they then need resharding under FSDP)."""
        return self.model is None

    def scorer(self, policy: nn.Module) -> TokenScorer:
        if self.model is not None:
            model = self.model
            return lambda tokens: token_logps(model, tokens)

        def base(tokens: torch.Tensor) -> torch.Tensor:
            with adapters_disabled(policy):
                return token_logps(policy, tokens)

        return base
