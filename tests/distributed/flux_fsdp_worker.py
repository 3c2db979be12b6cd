"""Worker for the FLUX FSDP loss-parity test: `torchrun --nproc-per-node N flux_fsdp_worker.py OUT`.

Trains the flux_debug config for a few fp32 steps with a real Trainer (FSDP over N processes when
N > 1) and writes the per-step losses and gradient norms (rank 0) to OUT as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.trainer import Trainer  # noqa: E402

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
        records = trainer.train()
        if trainer.is_writer:
            result = {
                "losses": [r.loss for r in records],
                "grad_norms": [r.grad_norm for r in records],
                "fsdp": trainer.parallel.dims.fsdp_enabled,
            }
            out.write_text(json.dumps(result), encoding="utf-8")
    finally:
        trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
