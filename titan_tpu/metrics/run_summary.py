"""The first and last lines of a run, and the time left on every step line in between.

    run: model llama3 debug (Llama3Model), 6.30M parameters | 1 process (dp_replicate 1 x dp_shard 1
    x tp 1) | float32 | data: ... | 30 steps | outputs in outputs/llama3_debug
    step 10/30 | loss ... | 0.212 s/step | eta 4s
    done: 30 steps in 8s | 61,440 tokens, 7,612.3 tokens/s per process | final loss 2.5302 | outputs
    in outputs/llama3_debug: metrics.jsonl, loss.png

The time left is the mean time per step since the first record times the steps still to go: the
first record's step (which compiles, fills the allocator or makes GRPO's first rollout) is behind
the anchor, while the evaluations and checkpoints between records, which recur, are in the mean.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from titan_tpu.metrics.console import count, duration
from titan_tpu.metrics.logger import METRICS_FILE, StepRecord


@dataclass(frozen=True)
class RunStart:
    """What a run trains, on what, for how long and where its outputs go."""

    model: str  # name, flavor and class: "llama3 debug (Llama3Model)"
    parameters: int
    layout: str  # the parallelism degrees
    processes: int
    dtype: str  # the compute dtype
    data: str  # the task's own words (TrainingTask.describe_data)
    steps: int  # training.steps
    first_step: int  # the first step this session trains (> 1 when resumed)
    dump_folder: Path
    checkpoint_folder: Path | None  # None when checkpoints are off

    def line(self) -> str:
        processes = f"{self.processes} process{'es' if self.processes != 1 else ''}"
        if self.first_step == 1:
            steps = f"{self.steps} steps"
        elif self.first_step > self.steps:
            steps = f"already at step {self.steps} of {self.steps}: nothing to train"
        else:
            steps = f"steps {self.first_step}-{self.steps} of {self.steps} (resumed)"
        return (
            f"run: model {self.model}, {count(self.parameters)} parameters | {processes} ({self.layout}) | "
            f"{self.dtype} | data: {self.data} | {steps} | outputs in {self.dump_folder}"
        )


class RunReport:
    """Times a run from its start: the time left at each record and the totals of its last line."""

    def __init__(self, start: RunStart, clock: Callable[[], float] = time.perf_counter) -> None:
        self.start = start
        self.clock = clock
        self.started = clock()
        self._anchor: tuple[int, float] | None = None  # (step, time) of the first record

    def eta_s(self, step: int) -> float | None:
        """Seconds left after `step`, called once per record; None at the first record, whose step
        holds the start-up work (compilation, the first rollout) that later steps do not repeat."""
        now = self.clock()
        if self._anchor is None:
            self._anchor = (step, now)
            return None
        first, then = self._anchor
        if step <= first or step >= self.start.steps:  # nothing to average yet, or nothing left
            return None
        return (now - then) / (step - first) * (self.start.steps - step)

    def final_line(self, step: int, records: Sequence[StepRecord], chart: Path | None) -> str:
        """Steps and wall time of this session, the items it trained (every process's) and the mean
        throughput per process (over the steps' own time, as the step lines count it), the last
        loss, and what the dump folder holds."""
        start = self.start
        done = max(step - start.first_step + 1, 0)
        wall = self.clock() - self.started
        head = "done" if step >= start.steps else f"stopped at step {step} of {start.steps}"
        parts = [f"{head}: {done} steps in {duration(wall)}"]
        if records:
            items, seconds = trained_items(records, start.first_step - 1, start.processes)
            unit = records[-1].unit
            rate = f", {items / seconds / start.processes:,.1f} {unit}/s per process" if seconds > 0 else ""
            parts += [f"{round(items):,} {unit}{rate}", f"final loss {records[-1].loss:.4f}"]
        parts.append(f"outputs in {start.dump_folder}: {', '.join(self._outputs(chart))}")
        return " | ".join(parts)

    def _outputs(self, chart: Path | None) -> list[str]:
        folder = self.start.dump_folder
        found = [METRICS_FILE] if (folder / METRICS_FILE).exists() else []
        checkpoints = self.start.checkpoint_folder
        if checkpoints is not None and checkpoints.is_dir():
            found.append(_within(checkpoints, folder) + "/")
        if chart is not None:
            found.append(_within(chart, folder))
        return found or ["nothing written"]


def trained_items(records: Sequence[StepRecord], before_first: int, processes: int) -> tuple[float, float]:
    """(items trained by every process, seconds of the steps themselves) over the records' windows:
    a record covers the steps since the previous one (`before_first`: the step before the first
    window), at its per-process throughput. Exact when every data-parallel rank trains as many
    items, as language-model and FLUX batches do; SFT's and GRPO's ranks differ a little."""
    items = seconds = 0.0
    previous = before_first
    for record in records:
        window = record.step_time_s * (record.step - previous)
        items += record.items_per_sec * window * processes
        seconds += window
        previous = record.step
    return items, seconds


def _within(path: Path, folder: Path) -> str:
    """`path` relative to `folder` when inside it, else whole."""
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return str(path)
