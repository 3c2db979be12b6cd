"""The frozen reference policy of GRPO's KL term (rl.beta > 0): the model the run started from, a frozen
copy or, with LoRA, the policy with its adapters switched off (`titan_tpu/tasks/reference_model.py`,
shared with preference training). A resumed run rebuilds the same reference, whatever the policy has
become. The adapter switch costs no memory; its forward leaves FSDP's last block gathered, so the
caller reshards."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_tpu.generation.logprobs import token_logps
from titan_tpu.models.common.lora import adapters_disabled
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.reference_model import initial_model_reference

TokenScorer = Callable[[torch.Tensor], torch.Tensor]


class KLReference:
    """Per-token log-probabilities under the reference: a frozen copy (`model`), or the policy with its
    adapters off when `model` is None."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model

    @classmethod
    def for_policy(cls, policy: nn.Module, ctx: TaskContext, args: Any) -> KLReference:
        return cls(initial_model_reference(policy, ctx, args, "rl.beta > 0"))

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
