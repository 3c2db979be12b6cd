"""Preference training (DPO and its variants) as a training task: pairs of a prompt with a chosen and a
rejected completion, rendered with the checkpoint's chat template, scored against a frozen reference.

Each micro-batch holds `local_batch_size` pairs as 2 x that many rows (chosen rows, then rejected rows,
as TRL's DPOTrainer concatenates them), so a pair's two sequences always share a micro-batch. The
reference's log-probabilities are computed when the batch is made, under no_grad; the loss is the
mean over the micro-batch's pairs (`loss.py`). Every micro-batch holds as many pairs, so the trainer's
mean over micro-batches and data parallelism's mean over ranks make it the mean over the global batch
of `training.global_batch_size` pairs, as TRL's per-device means averaged over devices and
accumulation steps are.

Layouts: one process, FSDP, HSDP, tensor parallelism (not with loss parallel: each completion's
log-probability is summed from whole-vocabulary logits) and expert parallelism, as SFT. Not context or
pipeline parallelism, refused with one line by the task seam (a pipeline stage would need the pair's
two sequences and its reference log-probabilities on the last stage, which pipeline micro-batches
of rows do not keep together).

Throughput counts the tokens of both sequences of every pair (not padding); FLOPs per token are the
policy's forward and backward plus the reference's forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.loader import stateful_loader
from titan_tpu.data.preference_dataset import Fitting, PreferenceDataset, first_epoch_summary
from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.metrics.console import ConsoleView
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.decoder import decoder_args, decoder_workload, language_model_loss
from titan_tpu.tasks.dpo.batch import PreferenceBatch, preference_batch, sequence_logps
from titan_tpu.tasks.dpo.config import DpoConfig
from titan_tpu.tasks.dpo.data import fingerprint, fitting_of, held_out_records, preference_encoding, training_records
from titan_tpu.tasks.dpo.evaluation import held_out_preferences
from titan_tpu.tasks.dpo.loss import PreferenceTerms, preference_loss
from titan_tpu.tasks.dpo.reference import Reference
from titan_tpu.tasks.validation import micro_batches_per_evaluation, require_held_out_rows

logger = logging.getLogger(__name__)

CONSOLE = ConsoleView(
    shown=(
        ("rewards/accuracies", "reward accuracy"),
        ("rewards/margins", "margin"),
        ("heldout_reward_accuracy", "held-out accuracy"),
    )
)
# The record's per-pair means, TRL's names; summed per micro-batch on the device (see `loss`).
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class DpoTask(TrainingTask):
    unit = "tokens"

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        config, parallel = ctx.config, ctx.parallel
        self.dpo = config.section(DpoConfig)
        language_model_loss(ctx)  # a family without a language-model head (FLUX) is refused here
        if parallel.loss_parallel_enabled:
            raise ConfigError(
                "parallelism.loss_parallel: DPO sums each completion's token log-probabilities from the whole "
                "vocabulary's logits, which loss parallel shards; set parallelism.loss_parallel = false"
            )
        seq_len, tp = config.training.seq_len, parallel.dims.tp
        self.sequence_sharded = parallel.dims.tp_enabled and parallel.sequence_parallel
        if self.sequence_sharded and seq_len % tp != 0:
            raise ConfigError(
                f"training.seq_len {seq_len}: sequence parallelism splits rows over parallelism.tp = {tp}; "
                "use a multiple of it (or parallelism.sequence_parallel = false)"
            )
        self.encoding = preference_encoding(config)
        self.records = training_records(config)
        self.fitting = fitting_of(config, self.encoding.pad_id, shuffle=True)
        # Every record is read, checked and fitted once here, before the model is built: a bad one
        # stops the run with its file and line, and the counts are reported once.
        self.summary = first_epoch_summary(self.records, self.encoding.encoder.encode, self.fitting)
        if ctx.is_writer:
            logger.info("dpo: %s: %s", self.records.description, self.summary.describe())
        self.held_out = held_out_records(config) if config.validation.enable else None
        if self.held_out is not None:
            found = first_epoch_summary(self.held_out, self.encoding.encoder.encode, self._held_out_fitting()).pairs
            require_held_out_rows(ctx, self.held_out.description, found, "preference pairs")
        self.args: Any = None
        self.reference: Reference | None = None
        self.dataloader: StatefulDataLoader | None = None
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None
        self._sums = torch.zeros(1 + len(PAIR_METRICS), dtype=torch.float64, device=ctx.device)

    def _held_out_fitting(self) -> Fitting:
        return fitting_of(self.ctx.config, self.encoding.pad_id, shuffle=False)

    # ------------------------------------------------------------------------------ set-up

    def model_args(self, args: Any) -> Any:
        self.args = decoder_args(self.ctx, self.encoding.tokenizer, args)
        return self.args

    def setup(self, model: nn.Module) -> None:
        ctx = self.ctx
        self.args = model.args  # as built: with the kernels the trainer measured, which the reference runs too
        self.reference = Reference.for_policy(model, ctx)
        dataset = PreferenceDataset(
            self.records,
            self.encoding.encoder.encode,
            self.fitting,
            ctx.dp_rank,
            ctx.dp_world,
            fingerprint(ctx.config, self.encoding.encoder),
        )
        self.dataloader = stateful_loader(dataset, ctx.local_batch_size, ctx.config.training.seed)

    def data_state(self) -> StatefulDataLoader | None:
        return self.dataloader

    def flops_per_item(self) -> float:
        # Per sequence token: the policy's forward and backward (the family's training FLOPs, 3 forwards)
        # and the reference's forward, counted as pretraining counts a token of a seq_len row.
        return self.ctx.spec.flops_per_token(self.args, self.ctx.config.training.seq_len) * 4 / 3

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        """A pair is two rows of up to training.seq_len tokens, each through the policy's forward and
        backward and the reference's forward."""
        row = decoder_workload(config, spec, args)
        pair = 2 * config.training.seq_len
        return Workload(
            row.unit,
            pair,
            pair,
            row.flops_per_item * 4 / 3,
            row.block_forward_flops_per_item,
            row.tp_replicated_flops_per_item * 4 / 3,
        )

    # ------------------------------------------------------------------------------ batches and loss

    def _batch(self, sample: dict[str, torch.Tensor], model: nn.Module) -> PreferenceBatch:
        """The micro-batch's rows with the reference's log-probabilities of its completions."""
        ctx = self.ctx
        fixed = ctx.config.training.seq_len if ctx.config.compile.enable else None
        multiple = ctx.parallel.dims.tp if self.sequence_sharded else 1
        batch = preference_batch(sample, multiple, fixed, ctx.device)
        assert self.reference is not None, "setup() builds the reference"
        batch.reference_logps = self.reference.logps(model, batch)
        return batch

    def next_batch(self, model: nn.Module) -> PreferenceBatch:
        if self._batches is None:
            assert self.dataloader is not None, "setup() builds the data loader"
            self._batches = iter(self.dataloader)
        return self._batch(next(self._batches), model)

    def _terms(self, logps: torch.Tensor, batch: PreferenceBatch) -> PreferenceTerms:
        assert batch.reference_logps is not None
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = batch.reference_logps.chunk(2)
        chosen_tokens, rejected_tokens = batch.completion_tokens.chunk(2)
        dpo = self.dpo
        return preference_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            chosen_tokens,
            rejected_tokens,
            loss_type=dpo.loss_type,
            beta=dpo.beta,
            label_smoothing=dpo.label_smoothing,
        )

    def loss(self, model: nn.Module, batch: PreferenceBatch) -> TaskLoss:
        output = model(batch.tokens)
        logps = sequence_logps(output, batch)
        terms = self._terms(logps, batch)
        loss = terms.loss
        if not isinstance(output, torch.Tensor):
            # A mixture of experts: its routers' load-balancing loss, as pretraining weighs it (TRL's
            # DPOTrainer adds router_aux_loss_coef x aux_loss the same way).
            loss = loss + output.aux_loss_coef * output.aux_loss
        chosen, rejected = logps.detach().chunk(2)
        per_pair = [
            terms.chosen_rewards,
            terms.rejected_rewards,
            terms.accurate,
            terms.chosen_rewards - terms.rejected_rewards,
            chosen,
            rejected,
        ]
        # Summed on the device: reading them here would make the host wait for every micro-batch.
        pairs = torch.full((1,), float(batch.pairs), dtype=torch.float64, device=logps.device)
        self._sums += torch.cat([pairs, torch.stack([v.sum() for v in per_pair]).double()])
        return TaskLoss(loss, items=batch.real_tokens)

    # ------------------------------------------------------------------------------ metrics

    def step_metrics(self) -> dict[str, float]:
        """Means over the pairs since the last record, of every data-parallel rank (every rank calls it
        on record steps)."""
        sums = sum_over(self._sums, self.ctx.parallel.dp_reduce_mesh).tolist()
        self._sums.zero_()
        pairs = sums[0]
        if pairs == 0:
            return {}
        return {name: value / pairs for name, value in zip(PAIR_METRICS, sums[1:])}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        if self.held_out is None:
            return {}
        return held_out_preferences(model, self._held_out_batches(model), self._terms, self.ctx)

    def _held_out_batches(self, model: nn.Module) -> Iterator[PreferenceBatch]:
        """This rank's share of the first validation.batches global batches of held-out pairs."""
        ctx = self.ctx
        assert self.held_out is not None
        encode = self.encoding.encoder.encode
        dataset = PreferenceDataset(self.held_out, encode, self._held_out_fitting(), ctx.dp_rank, ctx.dp_world, {})
        loader = stateful_loader(dataset, ctx.local_batch_size, ctx.config.training.seed)
        for sample in islice(loader, micro_batches_per_evaluation(ctx)):
            yield self._batch(sample, model)

    def describe_data(self) -> str:
        summary, training = self.summary, self.ctx.config.training
        epochs = training.steps * training.global_batch_size / summary.pairs
        return (
            f"{self.records.description}: {summary.pairs:,} pairs, {summary.tokens:,} tokens "
            f"({summary.completion_tokens:,} in completions) an epoch; {training.steps} steps x "
            f"{training.global_batch_size} pairs = {epochs:.2f} epochs"
        )

    def console_view(self, loss: float, extras: Mapping[str, float]) -> ConsoleView:
        return CONSOLE
