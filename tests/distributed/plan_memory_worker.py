"""Worker for the planner's memory check: `torchrun --nproc-per-node N plan_memory_worker.py OUT LAYOUT...`.

Trains each named layout one step (so AdamW has its state), runs one more forward + backward (so
every gradient exists) and writes, per rank, the bytes its parameters, gradients and optimizer state
hold locally to OUT/<layout>.rank<r>.json. For a pipeline layout that forward + backward runs from
zeroed gradients under a live-tensor count, and `step_total` is the rank's parameters and optimizer
state plus the peak of what the step creates (activations, gathered parameters, gradients, buffers
in flight). The layouts share the one process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.support.plan_measure import LiveTensorPeak, measure_state  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

# Layout name -> (config, overrides). Float32 as on this CPU; one step.
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    # FSDP 2 for attention, norms, router and embeddings; experts split over ep 2.
    "qwen3_moe_fsdp2_ep2": ("qwen3_moe_debug", ["--parallelism.dp_shard=2", "--parallelism.ep=2"]),
    "llama3_fsdp4": ("llama3_debug", ["--parallelism.dp_shard=4"]),
    # Qwen 3's per-head q/k norms are replicated over tp, its projections split.
    "qwen3_tp2_fsdp2": ("qwen3_debug", ["--parallelism.dp_shard=2", "--parallelism.tp=2"]),
    # Context parallelism 2 alone: FSDP shards over dp_shard x cp = 2 (titan_tpu/distributed/parallel_dims.py).
    "llama3_cp2": ("llama3_debug", ["--parallelism.cp=2", "--parallelism.dp_shard=1"]),
    # Pipeline 2 (1F1B) x FSDP 2: pp rank 0 holds the embedding and layers 0-1, rank 1 layers 2-3, the
    # norm and the head, each sharded over its dp_shard pair.
    # Global batch 8: two micro-batches of 2 samples per pp rank, so rank 0 keeps two in flight.
    "llama3_pp2_fsdp2": (
        "llama3_debug",
        ["--parallelism.pp=2", "--parallelism.dp_shard=2", "--training.global_batch_size=8"],
    ),
}
# Layout name -> pp degree: global rank r is pp rank r // (processes / pp) (pp is the outermost mesh axis).
PIPELINE_DEGREES = {"llama3_pp2_fsdp2": 2}
COMMON = ["--training.steps=1", "--metrics.log_freq=1", "--training.dtype=float32", "--training.global_batch_size=4"]


def overrides(layout: str, dump_folder: Path) -> list[str]:
    return [*COMMON, *LAYOUTS[layout][1], f"--job.dump_folder={dump_folder}"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def step_total(trainer: Trainer) -> dict[str, int]:
    """State bytes, and the step's total: parameters + optimizer state + the live-tensor peak of one
    forward + backward from zeroed gradients (they are created in it, as in every step)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    state = [
        value for values in trainer.optimizer.state.values() for value in values.values() if torch.is_tensor(value)
    ]
    counter = LiveTensorPeak([_local(t) for t in [*trainer.model.parameters(), *state]])
    with counter:
        trainer.forward_backward()
    measured = measure_state(trainer.model, trainer.optimizer)
    return {**measured, "step_total": measured["parameters"] + measured["optimizer"] + counter.peak}


def main(out: Path, layouts: list[str]) -> None:
    trainer = None
    for layout in layouts:
        name, _ = LAYOUTS[layout]
        trainer = Trainer(load_config(name, overrides(layout, out / layout)))
        trainer.train()
        if layout in PIPELINE_DEGREES:
            measured = step_total(trainer)
        else:
            trainer.forward_backward()
            measured = measure_state(trainer.model, trainer.optimizer)
        (out / f"{layout}.rank{trainer.process.rank}.json").write_text(json.dumps(measured))
    if trainer is not None:
        trainer.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
