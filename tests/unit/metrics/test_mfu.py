"""MFU of work a task times itself (titan_tpu/metrics/mfu.py): `<work>_tflops` in a task's metrics
gets `<work>_mfu` beside it, against the run's peak, and nothing when the peak is unknown."""

from __future__ import annotations

import pytest

from titan_tpu.metrics.mfu import mfu_percent, task_flops_per_sec, with_task_mfu

GRPO_METRICS = {"reward_mean": 0.5, "rollout_tokens_per_sec": 300.0, "rollout_tflops": 2.0, "kl": 0.1}


def test_task_tflops_get_an_mfu_beside_them() -> None:
    """Catches an MFU off by the TFLOP/s scale (2 TFLOP/s on an 8 TFLOP/s peak is 25%, not 2.5e-11%),
    one put on values that are not TFLOP/s (the tokens/s rate beside it), or placed away from its
    rate in the record."""
    out = with_task_mfu(GRPO_METRICS, peak_flops=8e12)
    assert list(out) == ["reward_mean", "rollout_tokens_per_sec", "rollout_tflops", "rollout_mfu", "kl"]
    assert out["rollout_mfu"] == pytest.approx(25.0)
    assert task_flops_per_sec(GRPO_METRICS) == [2e12]  # what the trainer checks its peak against


def test_an_unknown_peak_gives_no_mfu() -> None:
    """Catches an MFU guessed (or written as 0 / inf) where the device's peak is unknown."""
    assert with_task_mfu(GRPO_METRICS, peak_flops=None) == GRPO_METRICS
    assert mfu_percent(1e12, None) is None and mfu_percent(1e12, 4e12) == 25.0
