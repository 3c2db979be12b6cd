"""The cross-entropy's chunk as a measured kernel (titan_tpu/models/common/loss_tunable.py).

Bugs caught: candidates that chunk the timed tokens alike (timed twice for nothing) or exceed the
memory budget; a chunk size whose loss or gradient is wrong slipping through the float32 check; a
vocab-sharded loss measured for a chunking it never runs; a compiling run whose loss is compiled
(slower inside a training step than the eager measured chunk) or left unmeasured; a forced chunk that
never reaches the training loss, or one above the budget accepted; a family that trains with the chunked
loss but does not list the tunable."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.cpu_kinds import DECISIONS
from titan_tpu.autotune.measure import check
from titan_tpu.config import load_config
from titan_tpu.models.common import loss as loss_module
from titan_tpu.models.common import loss_tunable
from titan_tpu.models.common.chunked_cross_entropy import CHUNK_ELEMENTS, chunked_cross_entropy
from titan_tpu.models.common.loss_tunable import LOSS_CHUNKS
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.registry import get_model_spec
from titan_tpu.protocols.tunable import KernelShape
from titan_tpu.training.trainer import Trainer

ARGS = LLAMA3_FLAVORS["debug"]  # vocab 512
SHAPE = KernelShape(torch.device("cpu"), torch.float32, batch=8, seq_len=256)  # 2048 tokens


def test_candidates_chunk_the_timed_tokens_differently_and_stay_within_the_budget() -> None:
    candidates = LOSS_CHUNKS.candidates(ARGS, SHAPE)
    # 2^26 down to 2^20 all hold the 2048 tokens in one chunk; 2^18 makes chunks of 512, 2^16 of 128.
    assert candidates == {"2^26": 2**26, "2^18": 2**18, "2^16": 2**16}
    assert all(0 < budget <= CHUNK_ELEMENTS for budget in candidates.values())
    assert LOSS_CHUNKS.config_override("2^18") == "--model.overrides.loss_chunk_elements=262144"


def test_a_loss_that_does_not_chunk_eagerly_is_not_measured() -> None:
    assert LOSS_CHUNKS.candidates(ARGS, dataclasses.replace(SHAPE, eager_loss=False)) == {"2^26": 2**26}


@pytest.mark.parametrize("decision", sorted(DECISIONS))
def test_a_compiling_run_measures_its_loss_chunk_and_runs_the_loss_eagerly(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, decision: str
) -> None:
    """Under either CPU decision (float32, or bf16 under autocast)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: DECISIONS[decision])
    overrides = [
        "--training.steps=1",
        "--model.attention_block=0",
        "--compile.enable=true",
        f"--job.dump_folder={tmp_path}",
    ]
    trainer = Trainer(load_config("llama3_debug", overrides))
    try:
        [choice] = [c for c in trainer.kernels if c.field == "loss_chunk_elements"]
        assert len(choice.times_ms) > 1, choice  # timed among candidates, not the budget kept unmeasured
        assert trainer.task.loss_fn is trainer.spec.loss_fn  # not a torch.compile wrapper
    finally:
        trainer.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_chunk_agrees_with_float32_and_a_wrong_one_is_refused(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    shape = dataclasses.replace(SHAPE, dtype=dtype)
    candidates = LOSS_CHUNKS.candidates(ARGS, shape)
    assert check(LOSS_CHUNKS, ARGS, shape, candidates) == {}

    def wrong_below_256_tokens(logits: torch.Tensor, labels: torch.Tensor, ignore: int, step: int) -> torch.Tensor:
        # A chunking bug: chunks of fewer than 256 tokens scale their logits by 5%.
        return chunked_cross_entropy(logits * (1.05 if step < 256 else 1.0), labels, ignore, step)

    monkeypatch.setattr(loss_tunable, "chunked_cross_entropy", wrong_below_256_tokens)
    assert list(check(LOSS_CHUNKS, ARGS, shape, candidates)) == ["2^16"]


def test_every_family_with_the_chunked_loss_lists_the_tunable() -> None:
    for name in ("llama3", "qwen3", "qwen3_moe"):
        assert LOSS_CHUNKS in get_model_spec(name).tunables, name


def test_a_forced_chunk_reaches_the_training_loss(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    steps: list[int] = []

    def recording(logits: torch.Tensor, labels: torch.Tensor, ignore: int, step: int) -> Any:
        steps.append(step)
        return chunked_cross_entropy(logits, labels, ignore, step)

    monkeypatch.setattr(loss_module, "chunked_cross_entropy", recording)
    overrides = [
        "--model.overrides.loss_chunk_elements=65536",
        "--training.steps=1",
        "--model.attention_block=0",
        f"--job.dump_folder={tmp_path}",
    ]
    trainer = Trainer(load_config("llama3_debug", overrides))
    try:
        assert trainer.model_args.loss_chunk_elements == 65536
        [choice] = [c for c in trainer.kernels if c.field == "loss_chunk_elements"]
        assert (choice.pick, choice.source) == ("2^16", "forced by the config")
        trainer.forward_backward()
    finally:
        trainer.close()
    assert steps and set(steps) == {65536 // ARGS.vocab_size}


def test_a_chunk_above_the_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="loss_chunk_elements must be -1 .auto. or 1..67108864"):
        dataclasses.replace(ARGS, loss_chunk_elements=2 * CHUNK_ELEMENTS)
