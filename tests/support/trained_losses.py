"""Train a built Trainer to its last step: the step it started at (after any resume) and its loss by
step, the form in which the resume tests compare runs."""

from __future__ import annotations

from titan_tpu.training.trainer import Trainer


def trained_losses(trainer: Trainer) -> tuple[int, dict[int, float]]:
    """Runs `trainer.train()` and closes the trainer, even when training fails."""
    start = trainer.step
    try:
        records = trainer.train()
    finally:
        trainer.close()
    return start, {r.step: r.loss for r in records}
