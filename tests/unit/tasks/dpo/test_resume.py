"""A DPO run stopped after a checkpoint and restarted in the same folder continues exactly like the run
that never stopped: the same pairs in the same order and the same reference, so the same losses bit
for bit.

Bugs caught: the data position not saved or not restored (the resumed run replays or skips pairs), a
reference rebuilt from the resumed policy instead of the initial weights (every log-ratio restarts at
0, the loss at log 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.launch import fixed_kernels
from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

BASE = [
    *fixed_kernels("dpo_qwen3_debug"),
    "--model.overrides={ n_layers = 1 }",
    "--training.dtype=float32",
    "--training.seq_len=48",
    "--training.global_batch_size=4",
    "--dpo.generated_pairs=64",
    "--data.shuffle_buffer=8",
    "--validation.enable=false",
    "--metrics.log_freq=1",
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
]


def _losses(folder: Path, steps: int) -> list[tuple[int, float]]:
    trainer = Trainer(
        load_config("dpo_qwen3_debug", [*BASE, f"--job.dump_folder={folder}", f"--training.steps={steps}"])
    )
    try:
        return [(record.step, record.loss) for record in trainer.train()]
    finally:
        trainer.close()


def test_a_resumed_run_continues_like_the_uninterrupted_one(tmp_path: Path) -> None:
    uninterrupted = _losses(tmp_path / "whole", 5)
    _losses(tmp_path / "stopped", 2)
    resumed = _losses(tmp_path / "stopped", 5)
    assert resumed == uninterrupted[2:]
    assert all(
        loss != pytest.approx(0.693147, abs=1e-4) for _, loss in resumed
    )  # the reference stayed the initial model
