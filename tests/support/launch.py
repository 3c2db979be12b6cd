"""Run a script under torchrun on this machine's CPU (gloo) and fail with its output if it fails; read
a layout worker's results back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return done


def launch_layout_worker(
    worker: Path, out_dir: Path, layouts: dict[str, str], reference: Callable[[Path], Any], timeout: float
) -> dict[str, Any]:
    """One 4-process launch of a layout worker, read back: its results.json, with each layout's
    captured run (`layouts`: result key -> the .pt file the worker saved it in) under "run", and
    `reference(out_dir)`, the single process run here, under "single". Prints where the time went."""
    from tests.support.parity import RunResult

    start = time.perf_counter()
    torchrun(4, worker, str(out_dir / "results.json"), timeout=timeout)
    elapsed = time.perf_counter() - start
    data = json.loads((out_dir / "results.json").read_text())
    for key, stem in layouts.items():
        data[key]["run"] = RunResult.load(out_dir / f"{stem}.pt")
    start = time.perf_counter()
    data["single"] = reference(out_dir)
    print(
        f"\n4-process launch {elapsed:.1f}s, single-process reference {time.perf_counter() - start:.1f}s; "
        f"per part: { {k: round(v, 1) for k, v in data['timings_s'].items()} }"
    )
    return data


def fixed_kernels(config: str) -> list[str]:
    """train.py arguments that pin the kernels "auto" would measure (titan_tpu/autotune/). Runs on
    different layouts that are compared with each other must run the same kernels, and measured
    choices may differ between them: each layout times at its own per-rank shapes, and timings vary
    from run to run. The choice itself has its own tests."""
    pinned = ["--model.attention_block=0"]
    if not config.startswith("flux"):
        pinned.append("--model.overrides.loss_chunk_elements=67108864")  # the budget, 2^26
    if config.startswith("qwen3_moe"):
        pinned.append("--model.moe_impl=padded_bmm")
    return pinned
