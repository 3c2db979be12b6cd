"""A restart that resumes from a checkpoint with other settings: the run's own peak lr, schedule,
step count and optimizer hyperparameters apply from the resumed step on, one line says which changed,
and a step count before the checkpoint's is refused. Catches the checkpoint's saved lr silently
winning over the command line (the schedule's base lr and the param groups are both restored by a
load)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from titan_tpu.config import ConfigError, load_config
from titan_tpu.config.sections import LRSchedulerConfig
from titan_tpu.optim import lr_multiplier
from titan_tpu.training.trainer import Trainer

BASE = [
    "--training.seq_len=32",
    "--training.global_batch_size=2",
    "--training.dtype=float32",
    "--metrics.log_freq=1",
    "--metrics.plot_loss=false",
    "--checkpoint.enable=true",
    "--checkpoint.interval=3",
    "--lr_scheduler.warmup_steps=2",
    "--lr_scheduler.decay_type=cosine",
]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why


def make_trainer(dump: Path, *overrides: str) -> Trainer:
    return Trainer(load_config("llama3_debug", [f"--job.dump_folder={dump}", *BASE, *overrides]))


def lrs_by_step(trainer: Trainer) -> dict[int, float]:
    try:
        return {record.step: record.lr for record in trainer.train()}
    finally:
        trainer.close()


def expected_lr(peak: float, step: int, total: int) -> float:
    """The lr optimizer step `step` (1-based) runs with."""
    return peak * lr_multiplier(step - 1, total, LRSchedulerConfig(warmup_steps=2, decay_type="cosine"))


@pytest.fixture
def saved_step_3(tmp_path: Path) -> Path:
    """A dump folder holding step 3 of a 6-step run at lr 1e-3."""
    lrs_by_step(make_trainer(tmp_path / "a", "--training.steps=6", "--optimizer.lr=1e-3"))
    (tmp_path / "b" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoint" / "step-3", tmp_path / "b" / "checkpoint" / "step-3")
    return tmp_path / "b"


def test_a_new_peak_lr_and_step_count_apply_from_the_resumed_step(
    saved_step_3: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        trainer = make_trainer(
            saved_step_3, "--training.steps=8", "--optimizer.lr=2e-3", "--optimizer.weight_decay=0.3"
        )
    assert trainer.step == 3
    decayed, undecayed = trainer.optimizer.param_groups
    assert (decayed["weight_decay"], undecayed["weight_decay"]) == (0.3, 0.0)
    lrs = lrs_by_step(trainer)
    for step in range(4, 9):
        assert lrs[step] == pytest.approx(expected_lr(2e-3, step, 8), rel=1e-12), step
        # The negative control: the checkpoint's own schedule (what a resume used to keep).
        assert lrs[step] != pytest.approx(expected_lr(1e-3, step, 6), rel=1e-3), step
    lines = [r.getMessage() for r in caplog.records if "resumed at step 3 with" in r.getMessage()]
    assert len(lines) == 1
    for change in ("optimizer.lr 0.001 -> 0.002", "optimizer.weight_decay 0.1 -> 0.3", "training.steps 6 -> 8"):
        assert change in lines[0]


def test_an_unchanged_restart_says_nothing_about_changes(saved_step_3: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="titan_tpu"):
        trainer = make_trainer(saved_step_3, "--training.steps=6", "--optimizer.lr=1e-3")
    trainer.close()
    assert not [r for r in caplog.records if "resumed at step" in r.getMessage() and " with " in r.getMessage()]


def test_a_step_count_before_the_checkpoint_is_refused(saved_step_3: Path) -> None:
    with pytest.raises(ConfigError, match=r"^training.steps: 2 is before step 3 of the checkpoint"):
        make_trainer(saved_step_3, "--training.steps=2", "--optimizer.lr=1e-3")
