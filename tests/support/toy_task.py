"""A training task written outside the package, as a user would write one: its own config section and
its own batches, built from the engine's public pieces only. Importing this module registers nothing;
`tests/unit/tasks/test_task_from_outside.py` registers it.

The task: each row repeats a random pattern of `toy.period` tokens, so the next token is predictable
after the first period; the loss is the family's next-token loss over the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_tpu.config import TrainConfig
from titan_tpu.config.sections import opt, require
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.decoder import decoder_args, decoder_workload, language_model_loss


@dataclass
class ToyConfig:
    period: int = opt(4, "Tokens in the pattern each row repeats.")
    vocab: int = opt(64, "Token ids of the patterns are drawn from [1, vocab).")

    def validate(self) -> None:
        require(self.period >= 2, "toy.period", f"must be >= 2, got {self.period}")
        require(self.vocab >= 2, "toy.vocab", f"must be >= 2, got {self.vocab}")


class ToyTask(TrainingTask):
    unit = "tokens"

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        self.toy = ctx.config.section(ToyConfig)
        self.loss_fn = language_model_loss(ctx)
        self.seq_len = ctx.config.training.seq_len
        self.generator = torch.Generator().manual_seed(ctx.config.training.seed * 1000 + ctx.dp_rank)
        self.args: Any = None
        self.batches = 0

    def model_args(self, args: Any) -> Any:
        self.args = decoder_args(self.ctx, build_tokenizer("byte"), args)
        return self.args

    def setup(self, model: nn.Module) -> None:
        self.chunk: int = model.args.loss_chunk_elements

    def next_batch(self, model: nn.Module) -> torch.Tensor:
        rows, period = self.ctx.local_batch_size, self.toy.period
        pattern = torch.randint(1, self.toy.vocab, (rows, period), generator=self.generator)
        self.batches += 1
        return pattern.repeat(1, self.seq_len // period + 2)[:, : self.seq_len + 1].to(self.ctx.device)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> TaskLoss:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        return TaskLoss(self.loss_fn(model(inputs), labels, self.chunk), items=labels.numel())

    def flops_per_item(self) -> float:
        return self.ctx.spec.flops_per_token(self.args, self.seq_len)

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        return decoder_workload(config, spec, args)

    def step_metrics(self) -> dict[str, float]:
        return {"toy/period": float(self.toy.period), "toy/batches": float(self.batches)}
