"""`rl.rollout_buckets` reaches the rollout: a GRPO task samples its prompts in that many batches
sorted by length, and trains on the same rows, completions and log-probabilities as with one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.token_sum_reward import REWARDS
from titan_tpu.config import ConfigError, load_config
from titan_tpu.generation import sampler
from titan_tpu.protocols.model_spec import Decoding
from titan_tpu.tasks.grpo.rollout import MicroBatch
from titan_tpu.training.trainer import Trainer

# Two-digit operands, so the "a+b=" prompts differ in length (4 to 6 tokens).
SMALL = [
    "--model.overrides={ n_layers = 1 }",
    "--training.dtype=float32",
    "--rl.max_new_tokens=6",
    "--rl.prompts_per_step=4",
    "--rl.group_size=2",
    "--training.global_batch_size=8",
    "--metrics.eval_freq=0",
    REWARDS,
]
GENERATE = sampler.generate  # the sampler's own, whatever a test has patched in


def first_rollout(tmp_path: Path, buckets: int, monkeypatch: pytest.MonkeyPatch) -> tuple[MicroBatch, list[list[int]]]:
    """The first micro-batch of the first rollout, and the prompts of each `generate` call it made."""
    asked: list[list[int]] = []

    def recording_generate(
        model: torch.nn.Module, decoding: Decoding, prompts: list[list[int]], *args: object
    ) -> sampler.Completions:
        asked.append(sorted(len(p) for p in prompts))
        return GENERATE(model, decoding, prompts, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "generate", recording_generate)
    overrides = [f"--job.dump_folder={tmp_path / str(buckets)}", *SMALL, f"--rl.rollout_buckets={buckets}"]
    trainer = Trainer(load_config("grpo_qwen3_debug", overrides))
    try:
        batch = trainer.task.next_batch(trainer.model)
    finally:
        trainer.close()
    return batch, asked


def test_bucketed_rollouts_train_on_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches the key ignored (one generate call) and rows that come back from their batches in
    another order or with another row's log-probabilities."""
    one, asked_once = first_rollout(tmp_path, 1, monkeypatch)
    split, asked_split = first_rollout(tmp_path, 2, monkeypatch)
    assert len(asked_once) == 1 and len(asked_split) == 2
    assert asked_split[0][-1] <= asked_split[1][0]  # the short prompts in one batch, the long in the other
    assert len(set(asked_once[0])) > 1, "prompt lengths must differ for the split to be by length"
    assert torch.equal(split.tokens, one.tokens) and torch.equal(split.mask, one.mask)
    torch.testing.assert_close(split.advantages, one.advantages, rtol=0, atol=0)
    assert split.old_logps is None and one.old_logps is None  # trained by the weights that sampled it


def test_rollout_buckets_below_one_are_refused() -> None:
    with pytest.raises(ConfigError, match="rl.rollout_buckets"):
        load_config("grpo_qwen3_debug", ["--rl.rollout_buckets=0"])
