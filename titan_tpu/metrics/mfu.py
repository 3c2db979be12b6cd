"""MFU: model FLOP/s as a percent of the device's peak, for the training step and for work a task
times on its own (GRPO's rollouts), all against the one peak the run measured or looked up.

A task reports such work in its step metrics as `<work>_tflops`, model TFLOP/s per process (as the
record's `tflops`); the record then carries `<work>_mfu` right after it.
"""

from __future__ import annotations

from collections.abc import Mapping

TASK_TFLOPS_SUFFIX = "_tflops"
TASK_MFU_SUFFIX = "_mfu"


def mfu_percent(flops_per_sec: float, peak_flops: float | None) -> float | None:
    """Percent of the peak; None when the peak is unknown (an MFU is never guessed)."""
    return 100 * flops_per_sec / peak_flops if peak_flops else None


def task_flops_per_sec(task_metrics: Mapping[str, float]) -> list[float]:
    """The FLOP/s of each `<work>_tflops` a task reported, so the peak can be checked against them."""
    return [1e12 * value for key, value in task_metrics.items() if key.endswith(TASK_TFLOPS_SUFFIX)]


def with_task_mfu(task_metrics: Mapping[str, float], peak_flops: float | None) -> dict[str, float]:
    """The task's metrics with `<work>_mfu` after each `<work>_tflops`; without them when the peak is
    unknown (a missing MFU is left out, not written as a number)."""
    out: dict[str, float] = {}
    for key, value in task_metrics.items():
        out[key] = value
        mfu = mfu_percent(1e12 * value, peak_flops) if key.endswith(TASK_TFLOPS_SUFFIX) else None
        if mfu is not None:
            out[key.removesuffix(TASK_TFLOPS_SUFFIX) + TASK_MFU_SUFFIX] = mfu
    return out
