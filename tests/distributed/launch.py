"""Run a script under torchrun on this machine's CPU (gloo) and fail with its output if it fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# train.py arguments of a tiny float32 deterministic debug Llama run, whose losses the resume and
# multi-host tests compare bit for bit; each adds its steps, checkpoints and layout.
DETERMINISTIC_DEBUG_RUN = [
    "--config",
    "llama3_debug",
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--training.deterministic=true",
    "--metrics.log_freq=1",
    "--data.shuffle_buffer=16",
]


def torchrun(nproc: int, script: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Each process gets one thread: several processes share the cores, and oversubscribed OpenMP
    threads would make the run many times slower."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(script), *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done
