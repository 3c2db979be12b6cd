"""Worker for the throughput-accounting test: `torchrun --nproc-per-node 4 throughput_worker.py OUT`.

Trains the same model under TP 2 x FSDP 2 and under FSDP 4 in one launch and writes, for each, the
per-process TFLOP/s and tokens/s of the last logging window as rank 0 reports them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

STEPS = 6
BASE = [
    # Wide and shallow: tensor parallelism's collectives grow with dim, its matmuls with dim^2, so a
    # wider model is the regime TP is for (on 4 single-thread processes over gloo).
    "--model.overrides.dim=512",
    "--model.overrides.n_layers=2",
    "--model.overrides.n_heads=8",
    "--model.overrides.n_kv_heads=8",
    "--training.seq_len=256",
    "--training.global_batch_size=8",
    "--training.dtype=float32",
    f"--training.steps={STEPS}",
    f"--metrics.log_freq={STEPS}",
]
LAYOUTS = {"tp2_fsdp2": ["--parallelism.tp=2", "--parallelism.dp_shard=2"], "fsdp4": ["--parallelism.dp_shard=4"]}


def main(out: Path) -> None:
    results: dict[str, dict[str, float]] = {}
    for name, layout in LAYOUTS.items():
        config = load_config("llama3_debug", [*BASE, *layout, f"--job.dump_folder={out.parent / name}"])
        # Both trainers share the one process group (closing the first would end it for the second).
        trainer = Trainer(config)
        records = trainer.train()
        window = records[-1]  # steps 2..STEPS: the first step's one-time costs are in its own record
        results[name] = {
            "tflops": window.tflops,
            "tokens_per_sec": window.items_per_sec,
            "step_time_s": window.step_time_s,
        }
        if trainer.is_writer:
            out.write_text(json.dumps(results))
    trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
