"""`scripts/bench.py --kernels`: a config's training throughput with each kernel candidate forced in
turn, beside what "auto" picked, for every dtype the machine computes natively (or the one
`--training.dtype=D` names).

    python scripts/bench.py --kernels --config llama3_debug --steps 30 --warmup 3

A shared CPU's speed drifts by 10-20% over minutes, more than the kernels differ, so runs timed one
after another cannot show a 5% difference. Instead every configuration of one kernel field (auto,
and each candidate forced) is a live Trainer in this process, built fresh and warmed up, and their
optimizer steps are interleaved: one step of each, in an order that starts one later every round,
`steps` rounds, with a matmul peak probe after every round. Adjacent steps meet the same machine, and
each step is taken against its round's median before the medians are compared (`Timed.step`). Auto
and the candidate it picked run the same kernels, so the gap between those two is printed too: it is
this machine's noise at this step count.

One JSON line per field, then a Markdown table: per dtype and field, every candidate's median
tokens/s and MFU (against the median probe), auto's pick, auto against the fastest forced candidate
(every configuration trains the same FLOPs per step, so the ratio is one of step times and of MFU
alike), and auto against its own pick forced (the noise).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class KernelRun(Protocol):
    """One live training run: what its kernels are, and one timed optimizer step at a time."""

    kernels: dict[str, str]  # field -> what it runs
    kernel_candidates: dict[str, list[str]]  # field -> the names auto chose among
    kernel_sources: dict[str, str]  # field -> how auto decided ("measured in 1.7 s", "cached", ...)
    items_per_step: int
    flops_per_step: float

    def step_seconds(self) -> float: ...

    def peak_flops(self) -> float | None: ...  # None: the device has no known peak

    def close(self) -> None: ...


Open = Callable[[str, list[str]], KernelRun]  # (config, overrides) -> a run built and ready to step


def native_dtypes() -> list[str]:
    from titan_tpu.device import native_bf16, resolve_device_type

    return ["float32", "bfloat16"] if native_bf16(resolve_device_type("auto")) else ["float32"]


@dataclass(frozen=True)
class Timed:
    """A configuration's step times over the interleaved rounds, and each round's median step (of
    every configuration)."""

    run: KernelRun
    seconds: list[float]
    round_medians: list[float]

    def step(self) -> float:
        """The typical step: the median over rounds of this step against its round's median, times
        the median round. The machine's drift between rounds (25% over minutes of long steps) then
        cancels: a configuration whose slow or fast step fell in a slow or fast round is not ranked
        by that round."""
        relative = [s / m for s, m in zip(self.seconds, self.round_medians)]
        return statistics.median(relative) * statistics.median(self.round_medians)

    def rate(self) -> float:
        return self.run.items_per_step / self.step()

    def mfu(self, peak: float | None) -> str:
        if peak is None:
            return "no peak"
        return f"{100 * self.run.flops_per_step / self.step() / peak:.1f}%"


def interleave(
    runs: dict[Any, KernelRun], rounds: int, probe: Callable[[], float | None]
) -> tuple[dict[Any, Timed], float | None]:
    """`rounds` rounds of one step of every run, each round starting one run later (so no run always
    follows the same one), and a peak probe after each; (the step times with their rounds' medians,
    the median peak)."""
    keys = list(runs)
    seconds: dict[Any, list[float]] = {key: [] for key in keys}
    peaks = []
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            seconds[key].append(runs[key].step_seconds())
        peaks.append(probe())
    round_medians = [statistics.median(seconds[key][r] for key in keys) for r in range(rounds)]
    known = [peak for peak in peaks if peak is not None]
    timed = {key: Timed(runs[key], seconds[key], round_medians) for key in keys}
    return timed, statistics.median(known) if known else None


def _warm(run: KernelRun, steps: int) -> KernelRun:
    for _ in range(steps):
        run.step_seconds()
    return run


def kernel_table(config: str, steps: int, warmup: int, overrides: list[str], open_run: Open) -> int:
    from titan_tpu.config import load_config
    from titan_tpu.models.registry import get_model_spec

    spec = get_model_spec(load_config(config, overrides).model.name)
    override_of = {t.field: t.config_override for t in spec.tunables}
    rows: list[str] = []
    # A dtype the command forces is the one measured; else every dtype the machine computes natively.
    forced_dtypes = [o.split("=", 1)[1] for o in overrides if o.startswith("--training.dtype=")]
    for dtype in forced_dtypes[-1:] or native_dtypes():
        # Scheduled steps for the warm-up and the rounds; no records or checkpoints in between.
        base = [
            "--metrics.log_freq=1000000",
            *overrides,
            f"--training.dtype={dtype}",
            f"--training.steps={warmup + steps}",
        ]
        first = open_run(config, base)  # learns the candidates
        # Fields with one candidate (or forced by the overrides) have nothing to compare.
        measured = {f: names for f, names in first.kernel_candidates.items() if len(names) > 1}
        for index, (field, names) in enumerate(measured.items()):
            # Every run of a field starts fresh, so all have trained the same steps on the same data:
            # an MoE step's cost follows the routing, which changes as the model learns. Only this
            # field's runs are alive at once: every run holds a model and its optimizer.
            auto = _warm(first if index == 0 else open_run(config, base), warmup)
            runs = {"auto": auto}
            try:
                for name in names:
                    runs[name] = _warm(open_run(config, [*base, override_of[field](name)]), warmup)
                timed, peak = interleave(runs, steps, auto.peak_flops)
            finally:
                for run in runs.values():
                    run.close()
            pick = auto.kernels[field]
            fastest = max(timed[name].rate() for name in names)
            print(
                json.dumps(
                    {
                        "config": config,
                        "dtype": dtype,
                        "field": field,
                        "pick": pick,
                        "decided": first.kernel_sources[field],  # the first run's: its start-up cost
                        "peak_tflops": None if peak is None else round(peak / 1e12, 4),
                        "step_seconds": {str(key): [round(s, 4) for s in t.seconds] for key, t in timed.items()},
                    }
                ),
                flush=True,
            )
            cells = ", ".join(f"{name} {timed[name].rate():.0f} ({timed[name].mfu(peak)})" for name in names)
            rows.append(
                f"| {config} | {dtype} | {field} | {cells} | {pick} "
                f"| {timed['auto'].rate():.0f} ({timed['auto'].mfu(peak)}) "
                f"| {100 * timed['auto'].rate() / fastest:.1f}% "
                f"| {100 * timed['auto'].rate() / timed[pick].rate():.1f}% |"
            )
        if not measured:
            first.close()
    print(f"\n{steps} interleaved rounds after {warmup} warm-up steps, medians of steps against their round's:")
    print(
        "| config | dtype | kernel | forced: items/s per process (MFU) | auto picks | auto | auto / fastest "
        "| auto / its pick forced (noise) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0
