"""Supervised fine-tuning as a training task: conversations (or prompt/completion pairs) rendered with
the checkpoint's chat template, packed into rows with document masking, loss on what the model
should learn (`sft.train_on`).

Loss normalisation: the mean cross-entropy per trained token of the whole global batch (every
micro-batch of every data-parallel rank of one optimizer step). Each micro-batch's loss is its sum
of token losses times dp_world x grad_accum_steps / (trained tokens of the global batch): the
trainer divides by grad_accum_steps and data parallelism averages gradients over dp_world, so the
gradient is the global sum over the global count, whatever the number of processes or
micro-batches. (A mean of per-micro-batch means would weigh a token of a short answer more than one
of a long answer, and differently on 1 and 4 processes.) The trained-token count of the step is
summed over ranks once per step, before its first forward; it stays on the device. A mixture-of-
experts model's router loss is weighted by the same share of tokens.

Throughput counts the tokens of examples (not padding): `tokens_per_sec` and MFU are on real work.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.loader import stateful_loader
from titan_tpu.data.sft_dataset import SftDataset, first_epoch_summary
from titan_tpu.data.sft_packing import IGNORE_INDEX
from titan_tpu.distributed.grad_utils import sum_over
from titan_tpu.metrics.console import ConsoleView
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.decoder import decoder_args, decoder_workload, language_model_loss, require_decoding
from titan_tpu.tasks.sft.answers import HeldOutAnswer, exact_answer_rate, held_out_answers, log_answer
from titan_tpu.tasks.sft.config import SftConfig
from titan_tpu.tasks.sft.data import ChatEncoding, fingerprint, held_out_records, packing_of, training_records
from titan_tpu.tasks.validation import held_out_loss, micro_batches_per_evaluation, require_held_out_rows

logger = logging.getLogger(__name__)

# The console line's values of the task (metrics.jsonl also keeps sft/fill, sft/trained_share and
# the held-out perplexity and counts).
CONSOLE = ConsoleView(shown=(("validation/loss", "validation/loss"), ("sft/exact_answers", "exact answers")))


class SftTask(TrainingTask):
    unit = "tokens"
    chunked_loss = True

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        self.sft = config.section(SftConfig)
        if self._generates() and ctx.parallel.dims.tp_enabled:
            raise ConfigError(
                "sft.eval_generations: generation with the KV cache runs data-parallel only; set it to 0 "
                "with parallelism.tp > 1 (held-out loss, [validation], still runs)"
            )
        if self.sft.packing and not ctx.spec.capabilities.separates_documents:
            # Packed examples share a row; a model that takes no document ids would let each attend to
            # the ones before it.
            raise ConfigError(
                f"sft.packing: model {ctx.spec.name} attends across packed examples (it takes no document "
                "ids); set sft.packing = false (one example per row)"
            )
        self.encoding = ChatEncoding.from_config(config)
        self.records = training_records(config)
        self.packing = packing_of(config, self.encoding, shuffle=True)
        # Every record is read, checked and packed once here, before the model is built: a bad one
        # stops the run with its file and line, and the counts are reported once.
        summary = first_epoch_summary(self.records, self.encoding.encode, self.packing)
        if ctx.is_writer:
            logger.info("sft: %s: %s", self.records.description, summary.describe())
        self.summary = summary
        self.loss_fn = language_model_loss(ctx)
        self.held_out = held_out_records(config) if config.validation.enable or self._generates() else None
        if config.validation.enable:
            self._check_held_out_rows()
        self.args: Any = None
        self.dataloader: StatefulDataLoader | None = None
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None
        self._step: deque[dict[str, torch.Tensor]] = deque()
        self._scale = torch.ones((), device=ctx.device)
        self._window = [0, 0, 0]  # example tokens, trained tokens, positions since the last record
        self._answers: list[HeldOutAnswer] = []

    def _check_held_out_rows(self) -> None:
        """Validation evaluates validation.batches global batches of distinct rows (all of them
        checked, like the training records, before the model is built)."""
        assert self.held_out is not None
        packing = packing_of(self.ctx.config, self.encoding, shuffle=False)
        found = first_epoch_summary(self.held_out, self.encoding.encode, packing).rows
        require_held_out_rows(self.ctx, self.held_out.description, found, "packed conversations")

    def _generates(self) -> bool:
        return self.sft.generates(self.ctx.config)

    def model_args(self, args: Any) -> Any:
        self.args = decoder_args(self.ctx, self.encoding.tokenizer, args)
        if self._generates():
            require_decoding(
                self.ctx, self.args, "sft.eval_generations", "set it to 0 (held-out loss, [validation], still runs)"
            )
        return self.args

    def setup(self, model: nn.Module) -> None:
        ctx = self.ctx
        args: Any = model.args  # the family's arguments dataclass, which every family's model keeps
        self.loss_chunk_elements: int = args.loss_chunk_elements
        dataset = SftDataset(
            self.records,
            self.encoding.encode,
            self.packing,
            ctx.dp_rank,
            ctx.dp_world,
            fingerprint(ctx.config, self.encoding),
        )
        self.dataloader = stateful_loader(dataset, ctx.local_batch_size, ctx.config.training.seed)
        if self.held_out is not None and self._generates():
            longest = ctx.config.training.seq_len
            self._answers = held_out_answers(self.held_out, self.encoding, self.sft.eval_generations, longest)

    def data_state(self) -> StatefulDataLoader | None:
        return self.dataloader

    def next_batch(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The next micro-batch; at a step's first, all of the step's are read and their trained
        tokens summed over ranks (the loss's denominator)."""
        if not self._step:
            if self._batches is None:
                assert self.dataloader is not None, "setup() builds the data loader"
                self._batches = iter(self.dataloader)
            ctx = self.ctx
            self._step.extend(islice(self._batches, ctx.grad_accum_steps))
            local = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in self._step)
            total = sum_over(torch.tensor(float(local), device=ctx.device), ctx.parallel.dp_reduce_mesh)
            self._scale = ctx.dp_world * ctx.grad_accum_steps / total
        return self._step.popleft()

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> TaskLoss:
        device = self.ctx.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        if self.sft.packing:
            output = model(input_ids, document_ids=batch["document_ids"].to(device, non_blocking=True))
        else:
            output = model(input_ids)  # one example per row: causal attention never sees the padding after it
        targets = int((batch["labels"] != IGNORE_INDEX).sum())
        mean = self.loss_fn(output, labels, self.loss_chunk_elements)
        tokens = int(batch["length"].sum())
        self._window = [self._window[0] + tokens, self._window[1] + targets, self._window[2] + labels.numel()]
        return TaskLoss(mean * (targets * self._scale), items=tokens)

    def flops_per_item(self) -> float:
        # Per example token, counted as pretraining counts a token of a seq_len row (attention over
        # the whole row; document masking skips some of that work, which is not subtracted).
        return self.ctx.spec.flops_per_token(self.args, self.ctx.config.training.seq_len)

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        return decoder_workload(config, spec, args)

    def describe_data(self) -> str:
        """The records, what one epoch of them packs into, and how many epochs training.steps is."""
        summary, training = self.summary, self.ctx.config.training
        counts = summary.counts
        kept = counts.examples - counts.dropped_too_long - counts.dropped_no_target
        # Global rows follow one another across epochs, so the steps take steps x global batch rows.
        epochs = training.steps * training.global_batch_size / summary.rows
        return (
            f"{self.records.description}: {kept:,} examples -> {summary.rows:,} rows of {training.seq_len}, "
            f"{summary.tokens:,} tokens ({summary.targets:,} trained on) an epoch; {training.steps} steps x "
            f"{training.global_batch_size} rows = {epochs:.2f} epochs"
        )

    def console_view(self, loss: float, extras: Mapping[str, float]) -> ConsoleView:
        return CONSOLE

    def step_metrics(self) -> dict[str, float]:
        tokens, targets, positions = self._window
        self._window = [0, 0, 0]
        if not positions:
            return {}
        return {"sft/fill": tokens / positions, "sft/trained_share": targets / max(tokens, 1)}

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self.held_out is None:
            return metrics
        if self.ctx.config.validation.enable:
            metrics.update(held_out_loss(model, self._validation_batches(), self.ctx, self.loss_chunk_elements))
        if self._generates():
            shown: list[tuple[HeldOutAnswer, str]] = []
            max_new = self.sft.max_new_tokens
            metrics.update(exact_answer_rate(model, self._answers, self.encoding, max_new, self.ctx, step, shown))
            if self.ctx.is_writer and shown:
                log_answer(step, *shown[0], self.encoding)
        return metrics

    def _validation_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's share of the first validation.batches global batches of held-out rows, the
        same rows every time (unshuffled, from the first record)."""
        ctx = self.ctx
        assert self.held_out is not None
        packing = packing_of(ctx.config, self.encoding, shuffle=False)
        dataset = SftDataset(self.held_out, self.encoding.encode, packing, ctx.dp_rank, ctx.dp_world, {})
        loader = stateful_loader(dataset, ctx.local_batch_size, ctx.config.training.seed)
        for batch in islice(loader, micro_batches_per_evaluation(ctx)):
            if not self.sft.packing:
                batch = {k: v for k, v in batch.items() if k != "document_ids"}
            yield batch
