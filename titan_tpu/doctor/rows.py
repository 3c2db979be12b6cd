"""One line of the doctor's report, and the rules that turn a measurement into a verdict.

- ok: measured and within what is expected.
- slow: measured below SLOW_FRACTION of the expected figure (the check's own reference: the peak
  table, the planner's bandwidth, the fastest candidate). Half, because every expected figure the
  doctor compares with is already a sustained one (a derated bandwidth, a data-sheet peak that large
  matmuls reach 70-90% of, the fastest of several kernels), and run-to-run noise on a busy machine is
  about 30%: a figure under half of it is a real shortfall, not noise, and is big enough to change a
  plan or a kernel choice.
- wrong: a result outside the check's stated tolerance. The only verdict that fails the run.
- unavailable: the thing checked does not exist here (splash attention on a CPU, a compile backend
  that is not installed), with why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Verdict = Literal["ok", "slow", "wrong", "unavailable"]
VERDICTS: tuple[Verdict, ...] = ("ok", "slow", "wrong", "unavailable")
# Worst first: the order in which rows of several ranks are merged (report.py).
SEVERITY: dict[str, int] = {"wrong": 3, "slow": 2, "unavailable": 1, "ok": 0}

SLOW_FRACTION = 0.5


@dataclass(frozen=True)
class Row:
    """`measured` and `expected` are numbers in `unit` (None when there is no number: a name, an
    unavailable kernel, no published figure); `detail` is a word the row needs besides: what is
    shown where nothing was measured (the device's name, the dtype picked), or the link a
    collective ran over ("fast": inside a slice or host, "slow": across them)."""

    check: str  # the group: device, dtype, matmul, attention, moe, collective, compile, training
    name: str
    measured: float | None
    expected: float | None
    unit: str
    verdict: Verdict
    reason: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        return cls(**data)


def speed_verdict(
    measured: float, expected: float | None, higher_is_better: bool = True, fraction: float = SLOW_FRACTION
) -> tuple[Verdict, str]:
    """ok, or slow when `measured` is under `fraction` of `expected` (over 1 / fraction of it for a
    time)."""
    if expected is None:
        return "ok", "no expected figure"
    ratio = measured / expected if higher_is_better else expected / measured
    if ratio < fraction:
        return "slow", f"{ratio:.2f} of the expected figure, under {fraction}"
    return "ok", f"{ratio:.2f} of the expected figure"


def error_verdict(error: float, tolerance: float) -> tuple[Verdict, str]:
    """ok within `tolerance` (relative error), wrong outside it (nan included)."""
    if error <= tolerance:
        return "ok", f"relative error {error:.2g} <= {tolerance:.2g}"
    return "wrong", f"relative error {error:.2g} > {tolerance:.2g}"
