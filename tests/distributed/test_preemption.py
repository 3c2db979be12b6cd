"""Preemption under FSDP 2, in one launch of titan-launch with 2 training processes (CPU, gloo): a
SIGTERM that reaches one rank stops both after the same step with a checkpoint of it, from which the
restart resumes bit for bit; then `kill -TERM` to the launcher, as the kubelet does to a pod's first
process, is passed on to both training processes, which save the step in progress and exit, and the
launcher exits with 143 within the grace period and restarts nothing although --max-restarts allows
it. The worker's parts: preemption_worker.py. One process: tests/unit/training/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_tpu.checkpoint import layout

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("preemption_worker.py")
STEPS, STOP = 6, 3  # as in the worker
GRACE_S = 30  # checkpoint.preemption_grace_s's default, which the worker runs with
START_DEADLINE_S = 300  # the resume part and the long run's first steps, on a busy 2-core machine

pytestmark = pytest.mark.slow


def launch(work: Path, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "titan_tpu.launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(WORKER),
        str(work),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:  # a file, not a pipe: nobody reads it while training runs
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_sigterm_under_fsdp2_saves_the_step_and_resumes_bitwise(tmp_path: Path) -> None:
    log = tmp_path / "launcher.log"
    proc = launch(tmp_path, log)
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        while not (tmp_path / "training").exists():
            if proc.poll() is not None:
                pytest.fail(f"the launcher ended early with {proc.returncode}:\n{log.read_text()[-6000:]}")
            assert time.monotonic() < deadline, f"the long run never started:\n{log.read_text()[-6000:]}"
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not end within {GRACE_S} s of SIGTERM:\n{log.read_text()[-6000:]}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-6000:]
    results = json.loads((tmp_path / "results.json").read_text())
    print(f"\nresume part {results['timings_s']['resume']} s; launcher ended {took:.1f} s after SIGTERM")

    # Only rank 1 was signalled; both stopped after step 3's optimizer step, with one checkpoint of it.
    saved = str(tmp_path / "preempted" / "checkpoint" / f"step-{STOP}")
    assert results["stops"] == [[signal.SIGTERM, STOP, saved]] * 2
    assert results["resumed_from"] == STOP
    data = torch.load(tmp_path / "resume.pt", weights_only=True)
    captured, loaded = data["captured"], data["loaded"]
    # Negative control: a checkpoint written before step 3's optimizer step would hold step 2's state.
    params = [key for key in captured[STOP] if key.startswith("param/")]
    assert not any(torch.equal(captured[STOP - 1][key], captured[STOP][key]) for key in params)
    assert sorted(loaded) == sorted(captured[STOP])
    assert all(torch.equal(loaded[key], captured[STOP][key]) for key in loaded), "loaded != state after step 3"
    uninterrupted, resumed = data["uninterrupted"], data["resumed"]
    assert resumed["steps"] == list(range(STOP + 1, STEPS + 1))
    assert resumed["losses"] == uninterrupted["losses"][STOP:], "losses after the resume differ"
    final = uninterrupted["state"]
    assert all(torch.equal(resumed["state"][key], final[key]) for key in final), "final weights or AdamW state differ"

    # kill -TERM to the launcher: passed on to both processes, which stopped after the same step.
    stopped = [json.loads((tmp_path / f"external-{rank}.json").read_text()) for rank in (0, 1)]
    assert stopped[0] == stopped[1] and stopped[0]["signum"] == signal.SIGTERM, stopped
    step = stopped[0]["step"]
    root = tmp_path / "external" / "checkpoint"
    assert step > 2 and layout.complete_steps(root) == [step]
    assert layout.read_manifest(root / f"step-{step}")["world_size"] == 2
    assert f"preempted at step {step} by SIGTERM: checkpoint saved in {root / f'step-{step}'} in " in text
    assert "launch: SIGTERM: the training processes were sent it to save and stop; not restarting them" in text
    # One attempt per rank: nothing was restarted after the preemption.
    assert [(tmp_path / f"starts-{rank}.txt").read_text() for rank in (0, 1)] == ["0\n", "0\n"]
