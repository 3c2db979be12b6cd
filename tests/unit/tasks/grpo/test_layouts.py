"""Which parallel layouts GRPO accepts: tensor parallelism without sequence or loss parallelism (the
rollout's prompts and one-token decode steps have any length, which a sequence shard cannot split, and
sampling needs whole-vocabulary logits). Each refusal is one line naming the keys to set. Parity of
the accepted layouts (FSDP, TP, EP) with one process: test_grpo_fsdp.py.

Bugs caught: a layout refused that works (TP), or accepted and then failing deep inside the first
rollout with a shape error (sequence parallel)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titan_tpu.config import ConfigError, load_config
from titan_tpu.distributed.parallel_dims import ParallelContext, ParallelDims
from titan_tpu.models.registry import get_model_spec
from titan_tpu.tasks.grpo.task import GRPOTask


def _task(dims: ParallelDims, sequence_parallel: bool = False, loss_parallel: bool = False) -> GRPOTask:
    parallel = ParallelContext(dims, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    config = load_config("grpo_qwen3_debug", [])
    ctx = SimpleNamespace(
        config=config, spec=get_model_spec(config.model.name), parallel=parallel, device=torch.device("cpu")
    )
    return GRPOTask(ctx)  # type: ignore[arg-type]


def test_tensor_parallelism_without_sequence_or_loss_parallelism_is_accepted() -> None:
    assert _task(ParallelDims(1, 1, 2, 1, 2)).rows > 0  # one tp group: no data-parallel mesh to build


@pytest.mark.parametrize(
    ("options", "dims", "message"),
    [
        ({"sequence_parallel": True}, ParallelDims(1, 2, 2, 1, 4), "parallelism.sequence_parallel = false"),
        ({"loss_parallel": True}, ParallelDims(1, 2, 2, 1, 4), "parallelism.loss_parallel = false"),
    ],
)
def test_a_layout_grpo_cannot_run_is_one_line(options: dict, dims: ParallelDims, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        _task(dims, **options)
    assert "\n" not in str(error.value)


def test_sequence_parallelism_without_tensor_parallelism_is_not_refused() -> None:
    # sequence_parallel defaults to true and does nothing with tp = 1: FSDP-only runs must not trip on it.
    assert _task(ParallelDims(1, 1, 1, 1, 1), sequence_parallel=True).rows > 0
