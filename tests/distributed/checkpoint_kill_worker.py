"""`python checkpoint_kill_worker.py STEP TRAIN_ARGS...`: train.py, except that the save of step STEP
stalls after this rank's data files are written and synced, before the metadata and the commit, so a
test can SIGKILL the run in the middle of that save (its storage is simply very slow from then on)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from titan_tpu.checkpoint import storage  # noqa: E402


def main() -> int:
    stall_step = int(sys.argv[1])
    write_data = storage.ChecksummingWriter.write_data

    def slow_write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        future = write_data(self, plan, planner)
        if Path(self.path).name.startswith(f".step-{stall_step}.tmp-"):
            (Path(self.path) / "STALLED").touch()  # tells the test the save is under way
            time.sleep(3600)
        return future

    storage.ChecksummingWriter.write_data = slow_write_data  # type: ignore[method-assign]
    return train.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
