"""A checkpoint saved under one layout loads under another and the next step's loss is the same
(within 1e-5 relative: only the order of floating-point sums changes).

One chain, one launch per direction:
    1 process, steps 1-2, saves step 2
      -> FSDP 4 loads step 2, trains 3-4, saves 3 and 4      (1 process -> FSDP 4: step 3 vs 1 process)
           -> 1 process loads step 3, trains 4              (FSDP 4 -> 1 process: step 4 vs FSDP 4)
           -> TP 2 x FSDP 2 loads step 3, trains 4          (FSDP 4 -> TP 2 x FSDP 2: step 4 vs FSDP 4)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from titan_tpu.config import load_config
from titan_tpu.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
ARGS = [
    "--training.seq_len=32",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--training.steps=4",
    "--metrics.log_freq=1",
    "--data.shuffle_buffer=16",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1",
    "--checkpoint.keep_latest_k=0",
]
REL = 1e-5


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_checkpoint_resume.py
    yield
    torch.set_num_threads(threads)


def torchrun(nproc: int, dump: Path, *layout: str) -> dict[int, float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(ROOT / "train.py"), "--config", "llama3_debug", *ARGS, f"--job.dump_folder={dump}", *layout,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def one_process(dump: Path, *extra: str) -> dict[int, float]:
    trainer = Trainer(load_config("llama3_debug", [*ARGS, f"--job.dump_folder={dump}", *extra]))
    try:
        return {r.step: r.loss for r in trainer.train()}
    finally:
        trainer.close()


def start_from(source: Path, step: int, dump: Path) -> Path:
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(source / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


def close(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
def test_reshard_between_layouts(tmp_path: Path) -> None:
    single = one_process(tmp_path / "single", "--training.steps=4", "--checkpoint.interval=2")
    fsdp4 = torchrun(4, start_from(tmp_path / "single", 2, tmp_path / "fsdp4"), "--parallelism.dp_shard=4")
    back = one_process(start_from(tmp_path / "fsdp4", 3, tmp_path / "back"))
    tp_dump = start_from(tmp_path / "fsdp4", 3, tmp_path / "tp2_fsdp2")
    tp = torchrun(4, tp_dump, "--parallelism.tp=2", "--parallelism.dp_shard=2")
    assert sorted(fsdp4) == [3, 4] and sorted(back) == [4] and sorted(tp) == [4]
    diffs = {
        "1 process -> FSDP 4": close(fsdp4[3], single[3]),
        "FSDP 4 -> 1 process": close(back[4], fsdp4[4]),
        "FSDP 4 -> TP 2 x FSDP 2": close(tp[4], fsdp4[4]),
    }
    print("relative next-step loss differences:", {k: f"{v:.2e}" for k, v in diffs.items()})
    assert all(v <= REL for v in diffs.values()), diffs
