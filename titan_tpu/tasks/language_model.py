"""Language-model pretraining: packed token sequences in, next-token cross-entropy out; with
`[validation] enable`, the held-out loss of a text source of its own (tasks/validation.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.data.documents import DocumentSource
from titan_tpu.data.files import FileSource
from titan_tpu.data.loader import PackedDataset, build_dataloader, build_source, stateful_loader
from titan_tpu.data.packing import BlockStart
from titan_tpu.data.sources import EmbeddedSource
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.distributed.context_parallel import split_for_rank
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.decoder import decoder_args, decoder_workload, language_model_loss
from titan_tpu.tasks.validation import (
    held_out_loss,
    held_out_rows,
    micro_batches_per_evaluation,
    require_held_out_rows,
)

_FIRST_BLOCK = BlockStart(epoch=0, block=0, first_sample=0, cursor=None, offset=0)


def documents_after_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """[B, S] document ids of packed rows: the packer ends every document with eos, so a document
    begins after each eos (an eos belongs to the document it ends)."""
    ends = (input_ids == eos_id).long()
    return ends.cumsum(dim=1) - ends


@contextlib.contextmanager
def _validation_keys() -> Iterator[None]:
    """The data modules name the [data] key whose value they were given; for the held-out source
    that value came from [validation], and the message should say so."""
    try:
        yield
    except ConfigError as error:
        message = str(error)
        if message.startswith(("data.path:", "data.source:", "data.hf_split:")):
            raise ConfigError("validation." + message.removeprefix("data.")) from None
        raise


def rows_in_one_pass(dataset: PackedDataset, limit: int) -> int:
    """Packed rows one pass over the dataset's source holds, counted up to `limit` (the stream
    itself starts the source again after its last row)."""
    found = 0
    for block in dataset.blocks(_FIRST_BLOCK):
        if block.start.epoch > 0 or found >= limit:
            break
        found += len(block)
    return min(found, limit)


def source_in_words(source: DocumentSource) -> str:
    """The source's description, with the count and size of its files where it reads files (a Hugging
    Face dataset streams: its size is known only after a pass)."""
    files = source.files if isinstance(source, (EmbeddedSource, FileSource)) else []
    if not files:
        return source.description
    size = sum(path.stat().st_size for path in files)
    return f"{source.description}: {len(files):,} files, {size / 1e6:,.1f} MB"


class LanguageModelTask(TrainingTask):
    """Batches `{"input_ids", "labels"}` of `seq_len` tokens from the configured corpus; the loss is
    the model family's own (`ModelSpec.loss_fn`: cross-entropy, plus the router's auxiliary loss for
    mixture-of-experts models)."""

    unit = "tokens"
    chunked_loss = True
    context_parallel = True
    pipeline_parallel = True

    def __init__(self, ctx: TaskContext) -> None:
        super().__init__(ctx)
        config = ctx.config
        self.seq_len = config.training.seq_len
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        self.loss_fn = language_model_loss(ctx)
        self.args: Any = None
        self.dataloader: StatefulDataLoader | None = None
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None
        validation = config.validation
        if validation.enable and validation.source == "generated":
            raise ConfigError(
                "validation.source: 'generated' is the sft task's generated held-out conversations; the "
                "language_model task reads held-out text from 'files' or 'huggingface' (validation.path)"
            )
        self.validation_source: DocumentSource | None = None
        dims = ctx.parallel.dims
        if dims.cp_enabled and not ctx.spec.capabilities.context_parallel:
            raise ConfigError(
                f"parallelism.cp = {dims.cp}: model {ctx.spec.name} has no context-parallel attention "
                "(llama3 and qwen3 have); set parallelism.cp = 1"
            )
        if config.data.document_mask and not ctx.spec.capabilities.separates_documents:
            raise ConfigError(
                f"data.document_mask: model {ctx.spec.name} attends across packed documents (it takes no "
                "document ids); set data.document_mask = false"
            )

    def model_args(self, args: Any) -> Any:
        self.args = decoder_args(self.ctx, self.tokenizer, args)
        return self.args

    def setup(self, model: nn.Module) -> None:
        ctx = self.ctx
        # The loss's chunk, as the run chose it (titan_tpu/autotune/ replaced "auto" in model.args).
        args: Any = model.args  # the family's arguments dataclass, which every family's model keeps
        self.loss_chunk_elements: int = args.loss_chunk_elements
        self.dataloader = build_dataloader(
            ctx.config.data,
            self.tokenizer,
            seq_len=self.seq_len,
            local_batch_size=ctx.local_batch_size,
            dp_rank=ctx.dp_rank,
            dp_world_size=ctx.dp_world,
            seed=ctx.config.training.seed,
        )
        if ctx.config.validation.enable:
            self._setup_validation()

    def _setup_validation(self) -> None:
        """The held-out source, read through the same tokenizer and packing as training, and checked
        now, before training starts: it must hold validation.batches x training.global_batch_size rows."""
        config = self.ctx.config
        validation = config.validation
        source = validation.source
        if source == "generated":  # refused in __init__; the test narrows the type to a data source
            raise RuntimeError("validation.source = 'generated' reached the language-model task")
        held_out = dataclasses.replace(config.data, source=source, path=validation.path, hf_split=validation.hf_split)
        with _validation_keys():
            self.validation_source = build_source(held_out)
            found = rows_in_one_pass(self._validation_dataset(dp_rank=0, dp_world=1), held_out_rows(self.ctx))
        row = f"of training.seq_len + 1 = {self.seq_len + 1} tokens"
        require_held_out_rows(self.ctx, self.validation_source.description, found, row)

    def _validation_dataset(self, dp_rank: int, dp_world: int) -> PackedDataset:
        """A fresh, unshuffled packed stream of the held-out source: it starts at the source's first
        row, so every evaluation sees the same rows. Blocks no larger than the rows evaluated, so no
        more is tokenized than is read."""
        config = self.ctx.config
        assert self.validation_source is not None, "_setup_validation() builds the held-out source"
        return PackedDataset(
            self.validation_source,
            self.tokenizer,
            seq_len=self.seq_len,
            dp_rank=dp_rank,
            dp_world_size=dp_world,
            seed=config.training.seed,
            shuffle=False,
            shuffle_buffer=min(config.data.shuffle_buffer, held_out_rows(self.ctx)),
        )

    def _validation_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's held-out micro-batches: rows r, r+W, ... of the first
        validation.batches x training.global_batch_size, `local_batch_size` at a time."""
        ctx = self.ctx
        dataset = self._validation_dataset(ctx.dp_rank, ctx.dp_world)
        loader = stateful_loader(dataset, ctx.local_batch_size, ctx.config.training.seed)
        for batch in islice(loader, micro_batches_per_evaluation(ctx)):
            if ctx.config.data.document_mask:
                batch["document_ids"] = documents_after_eos(batch["input_ids"], self.tokenizer.eos_id)
            yield batch

    def data_state(self) -> StatefulDataLoader | None:
        return self.dataloader

    def describe_data(self) -> str:
        """The corpus, the tokenizer and the tokens the run's steps take from it."""
        assert self.dataloader is not None, "setup() builds the data loader"
        dataset = self.dataloader.dataset
        assert isinstance(dataset, PackedDataset), "build_dataloader packs a document source"
        training = self.ctx.config.training
        rows, tokens = training.global_batch_size, training.global_batch_size * self.seq_len * training.steps
        return (
            f"{source_in_words(dataset.source)}, {self.ctx.config.data.tokenizer} tokenizer; {rows} rows x "
            f"{self.seq_len} tokens a step, {tokens:,} tokens in all"
        )

    def next_batch(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self._batches is None:
            assert self.dataloader is not None, "setup() builds the data loader"
            # Created on first use, after a checkpoint may have restored the loader's position.
            self._batches = iter(self.dataloader)
        return next(self._batches)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> TaskLoss:
        device = self.ctx.device
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        # Every process of a model-parallel group counts the whole rows (the trainer divides by the
        # group's size): with cp > 1 each trains its share of them.
        items = labels.numel()
        input_ids, labels = self._cp_share(input_ids, labels)
        if self.ctx.config.data.document_mask:
            output = model(input_ids, document_ids=documents_after_eos(input_ids, self.tokenizer.eos_id))
        else:
            output = model(input_ids)
        return TaskLoss(self.loss_fn(output, labels, self.loss_chunk_elements), items=items)

    def _cp_share(self, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This cp rank's part of every row (the whole rows when cp = 1)."""
        if not self.ctx.parallel.dims.cp_enabled:
            return input_ids, labels
        cp_mesh = self.ctx.parallel.cp_mesh
        cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
        return split_for_rank(input_ids, cp, cp_rank), split_for_rank(labels, cp, cp_rank)

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input_ids, labels, items) of a batch on the device, for the pipeline schedule, which runs
        the model in stages and calls `pipeline_loss` on the last one; with cp > 1 this rank's part
        of the rows, counted as whole rows as in `loss`."""
        device = self.ctx.device
        labels = batch["labels"].to(device, non_blocking=True)
        input_ids, local_labels = self._cp_share(batch["input_ids"].to(device, non_blocking=True), labels)
        return input_ids, local_labels, labels.numel()

    def pipeline_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, labels, self.loss_chunk_elements)

    def flops_per_item(self) -> float:
        return self.ctx.spec.flops_per_token(self.args, self.seq_len)

    @classmethod
    def planned_workload(cls, config: TrainConfig, spec: ModelSpec, args: Any) -> Workload:
        return decoder_workload(config, spec, args)

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        """validation/loss, perplexity and tokens of the held-out rows, when [validation] is enabled."""
        if self.validation_source is None:
            return {}
        return held_out_loss(model, self._validation_batches(), self.ctx, self.loss_chunk_elements)
