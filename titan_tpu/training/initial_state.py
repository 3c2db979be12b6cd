"""Where a run's state comes from before its first step: the newest complete checkpoint (or
checkpoint.load_step), with this run's own settings applied from the resumed step on
(titan_tpu/training/resume_settings.py); without one, the weights of checkpoint.initial_load_path (a
Hugging Face folder), read lazily per rank; else the model's own initialisation."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from titan_tpu.checkpoint import CheckpointManager
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.config import TrainConfig
from titan_tpu.metrics.progress import Progress
from titan_tpu.optim import apply_config_on_resume
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.training.resume_settings import (
    changed_settings,
    check_lora_base,
    check_steps_left,
    resume_line,
    run_settings,
)

logger = logging.getLogger("titan_tpu")


def load_initial_state(
    config: TrainConfig,
    checkpointer: CheckpointManager,
    model: nn.Module,
    optimizer: Optimizer,
    lr_scheduler: LambdaLR,
    spec: ModelSpec,
    model_args: Any,
    is_writer: bool,
) -> int:
    """The step the run starts after (0 when it starts afresh). A LoRA run's checkpoints hold its
    adapters only: its frozen base comes from initial_load_path (or the model's own init) on a resume
    too, and a checkpoint of adapters trained on another base is refused before it is read."""
    lora = config.lora.enable
    step = checkpointer.load(check_settings=lambda folder, saved: check_lora_base(str(folder), saved, config))
    path = config.checkpoint.initial_load_path
    if step is not None:
        continue_from_checkpoint(config, step, checkpointer, optimizer, lr_scheduler, is_writer)
        if path and is_writer and not lora:
            logger.info("checkpoint: resumed at step %d, so initial_load_path is not used", step)
    if path and (step is None or lora):
        reading = Progress.starter("loading Hugging Face weights", "files") if is_writer else None
        what = model_name(config)
        load_hf_weights(model, path, spec.state_dict_adapter, model_args, what=what, progress=reading, frozen_only=lora)
        if is_writer:
            logger.info("checkpoint: %s from %s", "the frozen base's weights" if lora else "initial weights", path)
    return step or 0


def continue_from_checkpoint(
    config: TrainConfig,
    step: int,
    checkpointer: CheckpointManager,
    optimizer: Optimizer,
    lr_scheduler: LambdaLR,
    is_writer: bool,
) -> None:
    """This run's optimizer settings, schedule and step count from the resumed step on, and one line
    naming what it changes."""
    check_steps_left(config, step, str(checkpointer.root))
    apply_config_on_resume(optimizer, lr_scheduler, config.optimizer, config.lr_scheduler, config.training.steps)
    changes = changed_settings(checkpointer.resumed_settings, run_settings(config))
    if changes and is_writer:
        logger.info(resume_line(step, changes))
    if step == config.training.steps and is_writer:
        logger.info("checkpoint: step %d is training.steps: nothing left to train; raise it to go on", step)


def model_name(config: TrainConfig) -> str:
    """How messages name the model: `model NAME flavor FLAVOR`."""
    return f"model {config.model.name} flavor {config.model.flavor}"
