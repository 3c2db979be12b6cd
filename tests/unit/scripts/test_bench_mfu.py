"""`scripts/bench.py`'s single run: every timed step is set against the peak probed right after it,
and MFU is the median of those ratios. Bug caught: a run divided by one probe taken once (a shared
CPU that was slow or fast for that one second then decides the whole run's MFU); probes counted
into the steps' time."""

from __future__ import annotations

from pathlib import Path

import pytest

import titan_tpu.device as device
import titan_tpu.training.trainer  # noqa: F401  (bound to the real probe before the test replaces bench's)
from scripts import bench

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why

PEAK = 1e12


def test_mfu_is_the_median_of_steps_against_their_own_probes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The last probe lands on a machine 1000x faster: alone it would divide the run by 1000 PEAK.
    probes = iter([PEAK, PEAK, 1000 * PEAK])
    monkeypatch.setattr(device, "host_peak_flops", lambda *args, **kwargs: next(probes))
    record = bench.measure(
        "llama3_debug",
        3,
        0,
        [
            f"--job.dump_folder={tmp_path}",
            "--training.seq_len=64",
            "--training.global_batch_size=4",
            "--training.dtype=float32",
            "--metrics.plot_loss=false",
        ],
    )
    assert record is not None and next(probes, None) is None  # one probe per timed step
    assert record["peak_tflops"] == PEAK / 1e12
    # Two of three steps met PEAK; their step times differ, so the median is near the run's mean.
    assert record["mfu_percent"] == pytest.approx(100 * record["tflops_per_process"] * 1e12 / PEAK, rel=0.5)
