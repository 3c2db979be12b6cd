"""Peak host memory of this process per logging window, for runs on the CPU.

The kernel keeps the process's resident-set high-water mark (VmHWM in /proc/self/status). Writing
"5" to /proc/self/clear_refs (Linux >= 4.0) sets it back to the current resident size, so reading it
at the end of a window gives that window's peak, the same meaning the accelerators' reset peak
statistics have. getrusage's ru_maxrss is the peak since the process started and cannot be reset:
where /proc cannot be written it is used, and the first reset says once that the figure is the
peak since start, not the window's.
"""

from __future__ import annotations

import functools
import logging
import re
import resource
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_HIGH_WATER_MARK = "5"


def reset_peak_rss() -> bool:
    """Start a new window: the high-water mark becomes the current resident size. False where
    this system cannot reset it (not Linux, or /proc not writable)."""
    try:
        _CLEAR_REFS.write_text(_RESET_HIGH_WATER_MARK)
        return True
    except OSError as error:
        _say_peak_is_since_start(str(error))
        return False


def peak_rss_gib() -> float:
    """The process's resident-set peak since the last successful reset (or since start)."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        match = None
    if match is not None:
        return int(match.group(1)) / 2**20
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return max_rss / (2**30 if sys.platform == "darwin" else 2**20)


@functools.cache
def _say_peak_is_since_start(reason: str) -> None:
    logger.warning(
        "memory: cannot reset the CPU peak-memory mark (%s: %s); memory_gib is the process's peak "
        "since start, not each window's",
        _CLEAR_REFS,
        reason,
    )
