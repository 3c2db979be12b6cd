"""The fake tensors of the simulated step: every collective recorded, routing stood in for, the
live bytes counted.

A subclass of torch's FakeTensorMode because fake tensor mode is the mode every op reaches, also
those a tensor subclass (DTensor) issues inside its own dispatch, which a mode stacked above it
would not see.

Live bytes leave out two kinds of fake tensor that a real step never allocates. DTensor derives an
op's output shape by running it on fake tensors of the global shape, in whichever fake mode is
active (this one, entered a second time): what is made while this mode is entered more than once
is not counted. And the peak is read before each outermost op, when the tensors DTensor made to
propagate the previous one are gone; every RESCAN_EVERY outermost ops the sizes are read again, so
FSDP's resizes of its gathered buffers count from then (titan_tpu/dryrun/live_bytes.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_tpu.dryrun.collectives import Collective, collective_of
from titan_tpu.dryrun.live_bytes import LiveBytes
from titan_tpu.dryrun.routing import NOT_HANDLED, EvenRouting, bins

_aten = torch.ops.aten
RESCAN_EVERY = 256


class SimulatedTensors(FakeTensorMode):
    def __init__(self, axes: dict[str, tuple[str, int]]) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.axes = axes
        self.collectives: list[Collective] = []
        self.routing = EvenRouting()
        self.live = LiveBytes()
        self.recording = False
        self._entered = 0
        self._depth = 0  # ops inside ops (a DTensor op's local ops)
        self._outermost = 0  # outermost ops counted so far

    def __enter__(self) -> SimulatedTensors:
        self._entered += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._entered -= 1
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        counted = self.recording and self._entered == 1
        if counted and self._depth == 0:
            self._outermost += 1
            if self._outermost % RESCAN_EVERY == 0:
                self.live.rescan()
            self.live.sample()
        if self.recording:
            answer = self.routing.before(func, args, kwargs)
            if answer is not NOT_HANDLED:
                return answer
        self._depth += 1
        try:
            if self.recording and func is _aten.bincount.default:
                # Its size depends on the data: the routing stand-in gives it values, this its shape.
                out = super().__torch_dispatch__(_aten.new_zeros.default, types, (args[0], [bins(args, kwargs)]), {})
            else:
                out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if self.recording:
            self.routing.after(func, args, kwargs, out)
            collective = collective_of(func, args, out, self.axes)
            if collective is not None:
                self.collectives.append(collective)
        if counted:
            self.live.track(out)
        return out
