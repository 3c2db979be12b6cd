"""Resume under torchrun and after a crash: FSDP 2 resumes bitwise exactly, and a run SIGKILLed in the
middle of a save restarts from the previous checkpoint and reaches the uninterrupted run's loss."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.trained_losses import trained_losses
from titan_tpu.checkpoint import layout
from titan_tpu.config import load_config
from titan_tpu.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]

from tests.support import launch  # noqa: E402

KILL_WORKER = Path(__file__).with_name("checkpoint_kill_worker.py")
BASE = [*launch.DETERMINISTIC_DEBUG_RUN, "--checkpoint.enable=true", "--training.steps=20"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/support/one_thread.py says why


def torchrun(nproc: int, dump: Path, *args: str) -> dict[int, float]:
    launch.torchrun(nproc, ROOT / "train.py", *BASE, f"--job.dump_folder={dump}", *args, timeout=300)
    return losses(dump)


def losses(dump: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def copy_step(source: Path, step: int, dump: Path) -> None:
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")


@pytest.mark.slow
def test_fsdp2_resume_is_bitwise_exact(tmp_path: Path) -> None:
    """Also past a damaged newest checkpoint: step 20's files are checked half by each rank, and the
    one with a flipped byte (whichever rank checks it) sends both back to step 10."""
    fsdp = ["--parallelism.dp_shard=2", "--checkpoint.interval=10"]
    straight = torchrun(2, tmp_path / "straight", *fsdp)
    assert sorted(straight) == list(range(1, 21))
    # The run "stopped" after step 10: a dump folder holding what it had saved by then, and a step 20
    # that was damaged on disk.
    copy_step(tmp_path / "straight", 10, tmp_path / "resumed")
    damaged = tmp_path / "resumed" / "checkpoint" / "step-20"
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-20", damaged)
    largest = max((p for p in damaged.iterdir() if p.name != layout.MANIFEST), key=lambda p: p.stat().st_size)
    raw = bytearray(largest.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    largest.write_bytes(bytes(raw))
    resumed = torchrun(2, tmp_path / "resumed", *fsdp)
    assert sorted(resumed) == list(range(11, 21))
    mismatched = {s: (resumed[s], straight[s]) for s in resumed if resumed[s] != straight[s]}
    assert not mismatched, f"resumed != straight at {mismatched}"
    assert (damaged.parent / "step-20.damaged-corrupted" / largest.name).read_bytes() == bytes(raw)


def in_process(dump: Path, *args: str) -> tuple[int, dict[int, float]]:
    return trained_losses(Trainer(load_config(BASE[1], [*BASE[2:], f"--job.dump_folder={dump}", *args])))


@pytest.mark.slow
def test_killed_during_save_resumes_from_previous_checkpoint(tmp_path: Path) -> None:
    args = ["--checkpoint.interval=5", "--checkpoint.keep_latest_k=2"]
    dump = tmp_path / "killed"
    root = dump / "checkpoint"
    cmd = [sys.executable, str(KILL_WORKER), "10", *BASE, f"--job.dump_folder={dump}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as many threads as the in-process runs below
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list(root.glob(".step-10.tmp-*/STALLED")):
            if proc.poll() is not None:
                err = proc.stderr.read()[-3000:]  # type: ignore[union-attr]
                pytest.fail(f"run ended before the save of step 10: {err}")
            assert time.monotonic() < deadline, "the save of step 10 never started"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # Mid-save: the data files are there, the metadata and the commit are not.
    (temp,) = root.glob(".step-10.tmp-*")
    assert list(temp.glob("__0_*.distcp")) and not (temp / ".metadata").exists()
    assert layout.complete_steps(root) == [5]

    start, restarted = in_process(dump, *args)
    assert start == 5
    assert not temp.exists()  # the killed run's leftovers are cleaned
    assert layout.complete_steps(root) == [15, 20]

    _, uninterrupted = in_process(tmp_path / "uninterrupted", *args)
    print(f"step-20 loss: restarted {restarted[20]!r}, uninterrupted {uninterrupted[20]!r}")
    assert restarted[20] == uninterrupted[20]
