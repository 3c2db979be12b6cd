"""Timing and checking one tunable's candidates at the run's shapes; picking the fastest correct one."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from titan_tpu.protocols.tunable import KernelShape, Tunable, relative_error

# Timed rounds (one run of every candidate each) after one warm-up, which also builds any kernel
# caches and is timed only to spot a hopeless candidate: at least MIN_ROUNDS, then more until the
# rounds have taken BUDGET_S or MAX_ROUNDS are done. One run varies by 30% on a shared CPU, so three
# rounds ranked SDPA over blocks of 64 in one process of two while 40 ranked them 1.2x apart every
# time (llama3_debug, bf16, 2-core AMD EPYC); the budget buys those rounds where a run is short.
MIN_ROUNDS = 3
MAX_ROUNDS = 40
BUDGET_S = 1.5
# A candidate whose warm-up takes this many times the fastest warm-up is not timed further: it
# cannot win, and the slowest candidates (small blocks at long sequences) would cost the most
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
        worst = max(relative_error(g, w) for g, w in zip(got, want))
        if not worst <= limit:  # also refuses nan
            refused[name] = f"error {worst:.2g} > {limit:.2g}"
    return refused


def time_once(run: Run, value: Any, synchronize: Callable[[], None], timer: Callable[[], float]) -> float:
    """Seconds of one forward and backward."""
    start = timer()
    run(value)
    synchronize()
    return timer() - start


def time_candidates(
    run: Run, values: dict[str, Any], synchronize: Callable[[], None], timer: Callable[[], float]
) -> dict[str, float]:
    """Each candidate's median seconds over the timed rounds after a warm-up, or just its warm-up's
    time when that is over HOPELESS times the fastest warm-up.

    The runs go round-robin (every candidate once, then again), not one candidate's runs after
    another's: a machine whose speed drifts, or a neighbour that starts working midway, then slows
    every candidate alike instead of the ones timed last (timed one after another on a busy 2-core
    machine, the per-expert loop and padded matmuls read equal, and the slower one was kept, though
    it trains 2x slower)."""
    warm_up = {name: time_once(run, value, synchronize, timer) for name, value in values.items()}
    fastest = min(warm_up.values())
    samples: dict[str, list[float]] = {name: [] for name, t in warm_up.items() if t <= HOPELESS * fastest}
    spent, rounds = 0.0, 0
    while rounds < MIN_ROUNDS or (rounds < MAX_ROUNDS and spent < BUDGET_S):
        for name in samples:
            samples[name].append(time_once(run, values[name], synchronize, timer))
            spent += samples[name][-1]
        rounds += 1
    return {name: statistics.median(samples[name]) if name in samples else warm_up[name] for name in values}


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
    correct = {name: value for name, value in candidates.items() if name not in refused}
    seconds = time_candidates(run, correct, synchronize, timer) if correct else {}
    times: dict[str, float | None] = {name: 1e3 * seconds[name] if name in seconds else None for name in candidates}
    timed = [(t, i, name) for i, (name, t) in enumerate(times.items()) if t is not None]
    pick = min(timed)[2] if timed else tunable.fallback
    return Measured(pick, times, refused)
