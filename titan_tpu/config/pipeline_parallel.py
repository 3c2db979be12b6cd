"""The settings pipeline parallelism (`parallelism.pp`) cannot run with yet, each refused with one line.

The schedule splits each data-parallel rank's batch into `parallelism.pp_microbatches` itself, so the
trainer's gradient accumulation (training.local_batch_size) is not used on top of it. Not built for
pipelines: loss parallel (the loss runs inside the schedule), packed-document masking (document ids
would travel between stages) and the held-out evaluation (it runs the whole model on one rank). The
family and the task are checked by the trainer, which knows them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from titan_tpu.config.errors import ConfigError

if TYPE_CHECKING:
    from titan_tpu.config.loader import TrainConfig

# Schedules that run several stages on each pp rank (torch.distributed.pipelining's
# PipelineScheduleMulti; the zero-bubble one computes input and weight gradients apart, filling the
# bubble with the latter); the others run exactly one.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")


def check_pipeline_parallel(config: TrainConfig) -> None:
    parallelism = config.parallelism
    pp = parallelism.pp
    if pp == 1:
        return
    set_pp_1 = "set parallelism.pp = 1"
    refused = {
        "parallelism.loss_parallel": (parallelism.loss_parallel, "loss parallel", set_pp_1),
        "training.local_batch_size": (
            config.training.local_batch_size != -1,
            "gradient accumulation",
            "set it to -1 (the schedule's micro-batches, parallelism.pp_microbatches, take its place)",
        ),
        "data.document_mask": (config.data.document_mask, "packed-document masking", set_pp_1),
        "validation.enable": (config.validation.enable, "the held-out evaluation", set_pp_1),
    }
    for key, (requested, what, fix) in refused.items():
        if requested:
            raise ConfigError(f"{key}: {what} is not supported with parallelism.pp = {pp} yet; {fix}")
