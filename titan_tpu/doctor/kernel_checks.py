"""Every attention kernel and every MoE experts implementation: correct against its float32
reference, and its speed against the fastest of its kind.

The candidates are the ones the kernel chooser times (`titan_tpu/models/common/attention_tunable.py`,
`titan_tpu/models/qwen3/experts_tunable.py`), so a kernel added there is checked here without a change; what a
device does not offer is listed as unavailable. Speed: a kernel more than 1 / SLOW_FRACTION times
slower than the fastest at the same shape is `slow` (auto never picks it; a forced choice would
cost that much). Correctness uses the chooser's tolerances (`titan_tpu/autotune/measure.py`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, get_args

import torch

from titan_tpu.autotune.measure import in_run_precision, time_candidates, tolerance
from titan_tpu.device.dtype import dtype_name
from titan_tpu.device.select import Device
from titan_tpu.doctor.rows import Row, error_verdict, speed_verdict
from titan_tpu.doctor.sizes import Sizes
from titan_tpu.models.common.attention_kernels import splash_block
from titan_tpu.models.common.attention_tunable import ATTENTION
from titan_tpu.models.qwen3.args import ExpertImpl
from titan_tpu.models.qwen3.experts_tunable import EXPERTS
from titan_tpu.protocols.tunable import KernelShape, Tunable, relative_error


def attention_candidates(args: Any, shape: KernelShape) -> dict[str, Any]:
    """The attention kernels to check: the chooser's candidates for this device. A module-level
    function so a test can add a deliberately wrong kernel (the doctor's negative control)."""
    return ATTENTION.candidates(args, shape)


def _errors(tunable: Tunable, args: Any, shape: KernelShape, values: dict[str, Any]) -> dict[str, float]:
    """Each value's largest relative error (output and input gradients) against the reference's
    float32 result at `shape`, computed in `shape.dtype`; inf for a value that fails to run."""
    reference = tunable.candidates(args, shape)[tunable.reference]
    want = tunable.workload(args, shape)(reference, torch.float32)
    run = in_run_precision(tunable, args, shape)
    errors = {}
    for name, value in values.items():
        try:
            got = run(value)
        except (RuntimeError, ValueError, NotImplementedError):
            errors[name] = float("inf")
            continue
        errors[name] = max(relative_error(g, w) for g, w in zip(got, want))
    return errors


def _speed_rows(check: str, label: str, times_s: dict[str, float]) -> list[Row]:
    fastest_name = min(times_s, key=times_s.__getitem__)
    rows = []
    for name, seconds in times_s.items():
        verdict, ratio = speed_verdict(seconds, times_s[fastest_name], higher_is_better=False)
        rows.append(
            Row(
                check,
                f"{name} {label}",
                1e3 * seconds,
                1e3 * times_s[fastest_name],
                "ms",
                verdict,
                f"forward+backward; {ratio} (fastest: {fastest_name})",
            )
        )
    return rows


def _correctness_rows(check: str, errors: dict[str, float], limit: float, how: str) -> list[Row]:
    rows = []
    for name, error in errors.items():
        verdict, reason = error_verdict(error, limit)
        rows.append(Row(check, f"{name} correctness", error, limit, "rel. error", verdict, f"{how}: {reason}"))
    return rows


Timer = Callable[[], float]


def attention_rows(device: Device, sizes: Sizes, dtype: torch.dtype, timer: Timer = time.perf_counter) -> list[Row]:
    args, splash_op = sizes.attention, device.splash_attention_op()
    longest = KernelShape(device.torch_device, dtype, 1, max(sizes.attention_seq_lens), splash_op=splash_op)
    kernels = attention_candidates(args, longest)
    check_shape = dataclasses.replace(ATTENTION.check_shape(longest), dtype=torch.float32)
    errors = _errors(ATTENTION, args, check_shape, kernels)
    how = f"float32 against sdpa in float32, {check_shape.seq_len} tokens"
    rows = _correctness_rows("attention", errors, tolerance(torch.float32), how)
    if "splash" not in kernels:
        rows.append(Row("attention", "splash", None, None, "", "unavailable", _why_no_splash(device, longest)))
    correct = {name for name, error in errors.items() if error <= tolerance(torch.float32)}
    for seq_len in sizes.attention_seq_lens:
        shape = dataclasses.replace(longest, seq_len=seq_len)
        timed = {name: kernel for name, kernel in attention_candidates(args, shape).items() if name in correct}
        run = in_run_precision(ATTENTION, args, shape)
        times = time_candidates(run, timed, device.synchronize, timer)
        rows += _speed_rows("attention", f"{seq_len} tokens {dtype_name(dtype)}", times)
    return rows


def _why_no_splash(device: Device, shape: KernelShape) -> str:
    if device.type != "tpu":
        return "TPU only (torch.tpu.ops.splash_sdpa)"
    if shape.splash_op is None:
        return "torch_tpu's splash kernel needs jax: pip install jax"
    return f"no splash tile divides {shape.seq_len} tokens" if splash_block(shape.seq_len) is None else "not offered"


def expert_impls() -> list[str]:
    """Every implementation `GroupedExperts` has (the `ExpertImpl` type), "auto" aside."""
    return [name for name in get_args(ExpertImpl) if name != "auto"]


def moe_rows(device: Device, sizes: Sizes, dtype: torch.dtype, timer: Timer = time.perf_counter) -> list[Row]:
    """In the compute dtype, as the chooser checks them (grouped_mm runs in bf16 only), against the
    per-expert loop in float32, with skewed routing (experts_tunable.py)."""
    args = sizes.experts
    shape = KernelShape(device.torch_device, dtype, 1, sizes.expert_tokens, ragged_dot_op=device.ragged_dot_op())
    offered = EXPERTS.candidates(args, shape)
    errors = _errors(EXPERTS, args, EXPERTS.check_shape(shape), offered)
    how = f"{dtype_name(dtype)} against loop in float32"
    rows = _correctness_rows("moe", errors, tolerance(dtype), how)
    for name in expert_impls():
        if name not in offered:
            why = f"not offered on {device.type} in {dtype_name(dtype)} (titan_tpu/models/qwen3/experts_tunable.py)"
            rows.append(Row("moe", name, None, None, "", "unavailable", why))
    correct = {name: value for name, value in offered.items() if errors[name] <= tolerance(dtype)}
    if correct:
        times = time_candidates(in_run_precision(EXPERTS, args, shape), correct, device.synchronize, timer)
        rows += _speed_rows("moe", f"{sizes.expert_tokens} tokens {dtype_name(dtype)}", times)
    return rows
