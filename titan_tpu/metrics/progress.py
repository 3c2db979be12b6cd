"""Progress lines for the long waits before training: loading weights, converting a checkpoint, the
first (compiled) step.

    loading Hugging Face weights: 0/30 files, 0.0/140.0 GB, 0 s
    loading Hugging Face weights: 12/30 files, 56.1/140.0 GB, 41 s
    loading Hugging Face weights: 30/30 files, 140.0/140.0 GB, 95 s, done

One line when the work starts, then at most one every `every_s` seconds, and always one at the end, so
a 405B load shows that it moves without flooding the log (or a pod's log collector) line by line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("titan_tpu")


class Progress:
    """Counts work done out of a known total (and bytes, when given) and logs it, throttled."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        total_bytes: int | None = None,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        log: Callable[[str], None] = logger.info,
    ) -> None:
        self.what, self.total, self.unit, self.total_bytes = what, total, unit, total_bytes
        self.every_s, self.clock, self.log = every_s, clock, log
        self.done = 0
        self.done_bytes = 0
        self.start = self.last_line = clock()
        self.log(self.line())

    @classmethod
    def starter(cls, what: str, unit: str) -> Callable[[int, int], Progress]:
        """`(total, total_bytes) -> Progress`, for code that learns its totals only once it runs
        (which files of a folder this process reads)."""
        return lambda total, total_bytes: cls(what, total, unit, total_bytes)

    def advance(self, count: int = 1, nbytes: int = 0) -> None:
        """Record `count` more units (and `nbytes` bytes); logs when `every_s` has passed since the
        last line."""
        self.done += count
        self.done_bytes += nbytes
        now = self.clock()
        if now - self.last_line >= self.every_s:
            self.last_line = now
            self.log(self.line())

    def finish(self) -> float:
        """Log the final line whatever the throttle says; returns the seconds since the start."""
        self.log(self.line() + ", done")
        return self.clock() - self.start

    def line(self) -> str:
        parts = [f"{self.done}/{self.total} {self.unit}"]
        if self.total_bytes is not None:
            # In the unit of the total, so a debug model's 20 MB does not read 0.0/0.0 GB.
            scale, unit = (1e9, "GB") if self.total_bytes >= 1e9 else (1e6, "MB")
            parts.append(f"{self.done_bytes / scale:.1f}/{self.total_bytes / scale:.1f} {unit}")
        parts.append(f"{self.clock() - self.start:.0f} s")
        return f"{self.what}: {', '.join(parts)}"
