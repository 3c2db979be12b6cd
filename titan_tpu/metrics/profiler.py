"""`[profiling]`: a `torch.profiler` trace of chosen optimizer steps, each step annotated.

Steps start_step .. start_step + active_steps - 1 are traced (the first steps compile and fill the
allocator, so the default starts at step 3). Every rank writes its own Chrome trace,
`<dump_folder>/<trace_folder>/rank<R>_steps<A>-<B>.json`, which Perfetto (ui.perfetto.dev) and
TensorBoard open; each traced step is a `train_step <N>` range around its forward, backward and
optimizer step. What each device adds (CUDA kernels, the TPU's device trace, the CUDA allocator's
snapshot with `memory`) is in titan_tpu/device/tracing.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch.profiler

from titan_tpu.config.sections import ProfilingConfig
from titan_tpu.device.select import DeviceType
from titan_tpu.device.tracing import dump_memory_history, profiler_activities, profiler_options, start_memory_history

logger = logging.getLogger("titan_tpu")

# The range name of a traced step in the trace: f"{STEP_RANGE} {step}".
STEP_RANGE = "train_step"


class StepProfiler:
    """Wrap each optimizer step in `step(n)`; the configured ones are traced. `close()` writes the
    trace of a run that ended inside its window."""

    def __init__(self, config: ProfilingConfig, dump_folder: Path, rank: int, device_type: DeviceType) -> None:
        self.config = config
        self.folder = dump_folder / config.trace_folder
        self.rank = rank
        self.device_type = device_type
        self.first = config.start_step
        self.last = config.start_step + config.active_steps - 1
        self._profile: torch.profiler.profile | None = None
        self._recording_memory = False
        self._traced: list[int] = []

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if not self.config.enable or not self.first <= step <= self.last:
            yield
            return
        if self._profile is None:
            self._start()
        with torch.profiler.record_function(f"{STEP_RANGE} {step}"):
            yield
        self._traced.append(step)
        if step == self.last:
            self.close()

    def _start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._recording_memory = self.config.memory and start_memory_history(self.device_type)
        self._profile = torch.profiler.profile(
            activities=profiler_activities(self.device_type),
            record_shapes=True,
            profile_memory=self.config.memory,
            with_stack=False,
            experimental_config=profiler_options(self.device_type, self.folder, self.rank),
        )
        self._profile.start()

    def close(self) -> None:
        """Stop tracing and write the trace of the steps traced so far (nothing if none was)."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.stop()
        if not self._traced:
            return
        name = f"rank{self.rank}_steps{self._traced[0]}-{self._traced[-1]}"
        path = self.folder / f"{name}.json"
        profile.export_chrome_trace(str(path))
        if self._recording_memory:
            dump_memory_history(self.folder / f"{name}_memory.pickle")
            self._recording_memory = False
        if self.rank == 0:
            logger.info("profiling: steps %d-%d traced in %s", self._traced[0], self._traced[-1], path)
