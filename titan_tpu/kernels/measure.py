"""Timing and checking one tunable's candidates at the run's shapes; picking the fastest correct one."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_tpu.models.common.tunable import KernelShape, Tunable, relative_error

# Timed iterations per candidate after one warm-up (which also builds any kernel caches, and is
# timed only to spot a hopeless candidate).
ITERATIONS = 3
# A candidate whose warm-up alone takes this many times the best median so far is not timed further:
# it cannot win, and the slowest candidates (small blocks at long sequences) would cost the most
# start-up. The margin is wide because a first call also pays one-time costs.
HOPELESS = 4.0


def tolerance(dtype: torch.dtype) -> float:
    """The largest relative error (L2 over a tensor) against the float32 reference a candidate may
    have: a few float32 roundings, or a few bf16 ones (bf16 resolves 2^-8)."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2**-5


@dataclass(frozen=True)
class Measured:
    pick: str
    times_ms: dict[str, float | None]  # None: refused (wrong, or failed to run)
    refused: dict[str, str]  # name -> why


Run = Callable[[Any], list[torch.Tensor]]


def in_run_precision(tunable: Tunable, args: Any, shape: KernelShape) -> Run:
    """The tunable's workload at `shape`, computed as the run computes: under autocast to its dtype
    (inputs in float32 or in that dtype, as the tunable says they arrive), else in its dtype."""
    run = tunable.workload(args, shape)
    if not shape.autocast:
        return lambda value: run(value, shape.dtype)
    inputs = torch.float32 if tunable.float32_inputs_under_autocast else shape.dtype

    def under_autocast(value: Any) -> list[torch.Tensor]:
        with torch.autocast(shape.device.type, dtype=shape.dtype):
            return run(value, inputs)

    return under_autocast


def check(tunable: Tunable, args: Any, shape: KernelShape, candidates: dict[str, Any]) -> dict[str, str]:
    """Candidates that disagree with the reference's float32 result at the check shape (or fail to
    run there): name -> why."""
    small = tunable.check_shape(shape)
    want = tunable.workload(args, small)(candidates[tunable.reference], torch.float32)
    run = in_run_precision(tunable, args, small)
    limit = tolerance(shape.dtype)
    refused: dict[str, str] = {}
    for name, value in candidates.items():
        try:
            got = run(value)
        except (RuntimeError, ValueError, NotImplementedError) as error:
            refused[name] = f"failed: {str(error).splitlines()[0][:120]}"
            continue
        error = max(relative_error(g, w) for g, w in zip(got, want))
        if not error <= limit:  # also refuses nan
            refused[name] = f"error {error:.2g} > {limit:.2g}"
    return refused


def time_candidate(
    run: Run,
    value: Any,
    synchronize: Callable[[], None],
    timer: Callable[[], float],
    best: float = float("inf"),
) -> float:
    """Median seconds of one forward and backward, after a warm-up; just the warm-up's time when that
    is over HOPELESS times `best`, the best median so far."""
    start = timer()
    run(value)
    synchronize()
    warm_up = timer() - start
    if warm_up > HOPELESS * best:
        return warm_up
    samples = []
    for _ in range(ITERATIONS):
        start = timer()
        run(value)
        synchronize()
        samples.append(timer() - start)
    return statistics.median(samples)


def measure(
    tunable: Tunable,
    args: Any,
    shape: KernelShape,
    candidates: dict[str, Any],
    synchronize: Callable[[], None],
    timer: Callable[[], float],
) -> Measured:
    """Every correct candidate timed; the fastest wins, the earlier one on a tie. With none correct
    (the reference itself wrong in this dtype) the tunable's fallback is kept."""
    refused = check(tunable, args, shape, candidates)
    run = in_run_precision(tunable, args, shape)
    times: dict[str, float | None] = {}
    best = float("inf")
    for name, value in candidates.items():
        if name in refused:
            times[name] = None
            continue
        seconds = time_candidate(run, value, synchronize, timer, best)
        best = min(best, seconds)
        times[name] = 1e3 * seconds
    timed = [(t, i, name) for i, (name, t) in enumerate(times.items()) if t is not None]
    pick = min(timed)[2] if timed else tunable.fallback
    return Measured(pick, times, refused)
