"""A tunable whose candidates' costs and errors a test sets, timed by a clock the test owns, so the
kernel-choice logic (titan_tpu/autotune/) is tested without depending on this machine's speed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_tpu.protocols.tunable import KernelShape, Tunable


@dataclass
class FakeClock:
    """The timer the measurement reads; a fake kernel's run advances it by the kernel's cost."""

    now: float = 0.0
    reads: int = 0
    # A machine that slows as it works: the n-th kernel run costs slowdown^n times its cost.
    slowdown: float = 1.0
    runs: int = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@dataclass(frozen=True)
class FakeKernel:
    cost_s: float
    error: float = 0.0  # relative error of its output against the reference


@dataclass(frozen=True)
class FakeArgs:
    kernel: Any = "auto"


SHAPE = KernelShape(torch.device("cpu"), torch.float32, batch=2, seq_len=8)


def fake_tunable(kernels: dict[str, FakeKernel], clock: FakeClock) -> Tunable:
    """The first kernel is the reference and the fallback."""
    x = torch.linspace(1.0, 2.0, 64)

    def workload(args: Any, shape: KernelShape) -> Any:
        def run(kernel: FakeKernel, dtype: torch.dtype) -> list[torch.Tensor]:
            clock.now += kernel.cost_s * clock.slowdown**clock.runs
            clock.runs += 1
            return [(x * (1 + kernel.error)).to(dtype)]

        return run

    first = next(iter(kernels))
    return Tunable(
        field="kernel",
        is_auto=lambda args: args.kernel == "auto",
        candidates=lambda args, shape: dict(kernels),
        reference=first,
        fallback=first,
        workload=workload,
        check_shape=lambda shape: shape,
        key=lambda args, shape: (shape.batch, shape.seq_len),
        config_override=lambda name: f"--fake={name}",
        name_of=lambda args: str(args.kernel),
    )
