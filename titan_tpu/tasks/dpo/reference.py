"""The frozen reference policy of preference training: the model the run started from, a frozen copy
or the LoRA policy with its adapters switched off (`titan_tpu/tasks/reference_model.py`, shared with
GRPO's KL term).

Its log-probabilities are computed once per micro-batch, under no_grad, before the policy's forward.
Under FSDP a forward that no backward follows leaves the last block and the root gathered; they are
resharded at once.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_tpu.distributed.fsdp import reshard_all
from titan_tpu.models.common.lora import adapters_disabled
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.dpo.batch import PreferenceBatch, sequence_logps
from titan_tpu.tasks.reference_model import initial_model_reference


class Reference:
    """Log-probabilities of a batch's completions under the reference: `model` (a frozen copy), or the
    policy with its adapters off when `model` is None."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model

    @classmethod
    def for_policy(cls, policy: nn.Module, ctx: TaskContext) -> Reference:
        # The policy's arguments as built: with the kernels the trainer measured.
        return cls(initial_model_reference(policy, ctx, policy.args, "training.task = 'dpo'"))

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
