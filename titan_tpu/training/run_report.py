"""The trainer's side of the run's first and last lines (titan_tpu/metrics/run_summary.py): what it
knows about the run, gathered once training starts."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from titan_tpu.metrics.console import count
from titan_tpu.metrics.run_summary import RunReport, RunStart
from titan_tpu.optim import adamw_state_bytes

if TYPE_CHECKING:
    from titan_tpu.training.trainer import Trainer

logger = logging.getLogger("titan_tpu")


def count_parameters(model: nn.Module, trained_only: bool = False) -> int:
    """Every parameter of the whole model (or, `trained_only`, those that get gradients), each tensor
    once (a tied head adds nothing): counted on the model built on `meta`, before any layout shards it
    or cuts it into pipeline stages, or on the live one (a DTensor's numel is the whole tensor's)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trained_only)


def start_report(trainer: Trainer) -> RunReport:
    """The run's clock and, on the writing process, its start-up line."""
    config = trainer.config
    data = trainer.task.describe_data() if trainer.is_writer else ""
    start = RunStart(
        model=f"{config.model.name} {config.model.flavor} ({trainer.spec.model_cls.__name__})",
        parameters=trainer.parameter_count,
        layout=trainer.parallel.dims.describe(),
        processes=trainer.process.world_size,
        dtype=trainer.resolved.compute_dtype,
        data=data,
        steps=config.training.steps,
        first_step=trainer.step + 1,
        dump_folder=trainer.dump_folder,
        checkpoint_folder=trainer.checkpointer.root if config.checkpoint.enable else None,
    )
    if trainer.is_writer:
        logger.info(start.line())
        if config.lora.enable:
            logger.info(lora_line(trainer))
    return RunReport(start)


def lora_line(trainer: Trainer) -> str:
    """What a LoRA run trains: its adapters' parameters against the whole model's, where they sit, and
    the optimizer state they cost this process (the frozen base has none)."""
    lora = trainer.config.lora
    trained, total = trainer.adapter_params, count_parameters(trainer.model)
    kinds = ", ".join(dict.fromkeys(name.rpartition(".")[2] for name in trainer.lora_targets))
    state = adamw_state_bytes(trainer.trained_params)
    return (
        f"lora: {count(trained)} of {count(total)} parameters trained ({100 * trained / total:.3g}%): "
        f"rank {lora.rank}, alpha {lora.alpha:g} on {len(trainer.lora_targets)} linears ({kinds}); the rest frozen; "
        f"AdamW state {state / 2**20:.3g} MiB on this process"
    )
