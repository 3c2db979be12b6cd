"""Worker for the FLUX FSDP parity test: `torchrun --nproc-per-node N flux_fsdp_worker.py OUT`.

Trains the flux_debug config for a few fp32 steps with a real Trainer (FSDP over N processes when
N > 1) and saves (rank 0) the per-step losses and gradient norms and the full final state
(parity.RunResult) with whether FSDP was on, as {"run": ..., "fsdp": ...} in OUT (torch.save).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.parity import train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

STEPS = 5
OVERRIDES = [
    f"--training.steps={STEPS}",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    "--device.type=cpu",
    "--lr_scheduler.warmup_steps=1",
    "--metrics.log_freq=1",
    "--metrics.eval_freq=0",
    "--flux.caption_dropout=0.5",  # both conditioned and dropped captions in 5 x 4 samples
]


def main(out: Path) -> None:
    trainer = Trainer(load_config("flux_debug", [*OVERRIDES, f"--job.dump_folder={out.parent / out.stem}"]))
    try:
        run = train_and_capture(trainer)  # every rank: gathering the state is a collective
        if trainer.is_writer:
            torch.save({"run": dataclasses.asdict(run), "fsdp": trainer.parallel.dims.fsdp_enabled}, out)
    finally:
        trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
