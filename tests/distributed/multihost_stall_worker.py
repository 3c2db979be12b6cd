"""`python multihost_stall_worker.py STEP MARKERS TRAIN_ARGS...`: train.py, except that the first time a
rank has finished step STEP (and its checkpoint, if STEP saves one) it writes its pid to MARKERS/rank-R
and waits there, so a test can SIGKILL one training process of a running job at a known step. A rank
whose marker is already written belongs to a restarted attempt and trains on without waiting."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from titan_tpu.checkpoint import CheckpointManager  # noqa: E402

STALL_S = 600  # ends a forgotten process; a test kills the job long before


def main() -> int:
    stall_step, markers = int(sys.argv[1]), Path(sys.argv[2])
    marker = markers / f"rank-{os.environ['RANK']}"
    maybe_save = CheckpointManager.maybe_save

    def maybe_save_then_stall(self, step, last=False):  # type: ignore[no-untyped-def]
        saved = maybe_save(self, step, last=last)
        if step == stall_step and not marker.exists():
            partial = marker.with_suffix(".tmp")
            partial.write_text(str(os.getpid()))
            partial.rename(marker)  # whole or absent: the test reads the pid as soon as it appears
            # A parked rank stands for one blocked in a collective with the rank the test kills: the
            # collective fails, and the SIGTERM torchrun's agent sends ends the process at once
            # (PreemptionWatch.abandon). A sleeping process would only note it until SIGKILL.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(STALL_S)
        return saved

    CheckpointManager.maybe_save = maybe_save_then_stall  # type: ignore[method-assign]
    return train.main(sys.argv[3:])


if __name__ == "__main__":
    sys.exit(main())
