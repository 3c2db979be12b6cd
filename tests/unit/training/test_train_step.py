"""`Trainer.train_step`, the benchmarks' way in (scripts/bench.py), takes the same steps as
`Trainer.train()`. Bug caught: a benchmark timing a step that is not the training step (a schedule
or gradient reset missing, a forward outside the run's precision) or leaving the step count behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why

STEPS = 3
ARGS = [
    "--training.seq_len=64",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--training.deterministic=true",
    f"--training.steps={STEPS}",
    "--lr_scheduler.warmup_steps=1",  # the learning rate changes at every step
    "--metrics.log_freq=1",
    "--metrics.plot_loss=false",
]


def make_trainer(dump: Path) -> Trainer:
    return Trainer(load_config("llama3_debug", [f"--job.dump_folder={dump}", *ARGS]))


def test_train_step_takes_the_steps_train_takes(tmp_path: Path) -> None:
    trained = make_trainer(tmp_path / "train")
    try:
        losses = [record.loss for record in trained.train()]
        weights = {name: value.clone() for name, value in trained.model.state_dict().items()}
    finally:
        trained.close()
    stepped = make_trainer(tmp_path / "steps")
    try:
        stepped_losses = [float(stepped.train_step()[0]) for _ in range(STEPS)]
        assert stepped.step == STEPS
        assert stepped_losses == losses
        assert stepped.lr_scheduler.get_last_lr() == trained.lr_scheduler.get_last_lr()
        for name, value in stepped.model.state_dict().items():
            assert torch.equal(value, weights[name]), name
    finally:
        stepped.close()
