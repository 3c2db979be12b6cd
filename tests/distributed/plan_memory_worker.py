"""Worker for the planner's memory check: `torchrun --nproc-per-node N plan_memory_worker.py OUT LAYOUT...`.

Trains each named layout one step (so AdamW has its state), runs one more forward + backward (so
every gradient exists) and writes, per rank, the bytes its parameters, gradients and optimizer state
hold locally to OUT/<layout>.rank<r>.json. The layouts share the one process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from plan_measure import measure_state  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.trainer import Trainer  # noqa: E402

# Layout name -> (config, overrides). Float32 as on this CPU; one step.
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    # FSDP 2 for attention, norms, router and embeddings; experts split over ep 2.
    "qwen3_moe_fsdp2_ep2": ("qwen3_moe_debug", ["--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    "llama3_fsdp4": ("llama3_debug", ["--parallelism.dp_shard=4"]),
    # Qwen 3's per-head q/k norms are replicated over tp, its projections split.
    "qwen3_tp2_fsdp2": ("qwen3_debug", ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
    # Context parallelism 2 alone: FSDP shards over dp_shard x cp = 2 (titan_tpu/distributed/parallel_dims.py).
    "llama3_cp2": ("llama3_debug", ["--parallelism.cp=2", "--parallelism.dp_shard=1"]),
}
COMMON = ["--training.steps=1", "--metrics.log_freq=1", "--training.dtype=float32", "--training.global_batch_size=4"]


def overrides(layout: str, dump_folder: Path) -> list[str]:
    return [*COMMON, *LAYOUTS[layout][1], f"--job.dump_folder={dump_folder}"]


def main(out: Path, layouts: list[str]) -> None:
    trainer = None
    for layout in layouts:
        name, _ = LAYOUTS[layout]
        trainer = Trainer(load_config(name, overrides(layout, out / layout)))
        trainer.train()
        trainer.forward_backward()
        measured = measure_state(trainer.model, trainer.optimizer)
        (out / f"{layout}.rank{trainer.process.rank}.json").write_text(json.dumps(measured))
    if trainer is not None:
        trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
