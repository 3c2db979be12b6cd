"""Worker for the DPO layout test: `torchrun --nproc-per-node 2 dpo_layouts_worker.py OUT/results.json`.

A real `Trainer` runs DPO (`dpo_qwen3_debug`: generated sums, a frozen copy of the initial model as the
reference) on the Qwen 3 debug flavor with 2 layers (the config's), in float32, for 2 steps of 8 pairs taken in
micro-batches of 2 pairs, with the held-out evaluation at step 2: under FSDP 2, then under TP 2 with
sequence parallelism. Each run (losses, gradient norms, held-out loss, final state; parity.RunResult)
goes to OUT/<layout>.pt and its first step's gradients to OUT/<layout>_grads.pt; `reference()` is the
single process, run by the test.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402
from titan_tpu.distributed.sharded_init import canonical_name  # noqa: E402

STEPS = 2
BASE = [
    *fixed_kernels("dpo_qwen3_debug"),
    "--training.dtype=float32",
    f"--training.steps={STEPS}",
    "--training.seq_len=40",
    "--training.global_batch_size=8",
    "--training.local_batch_size=2",
    "--dpo.generated_pairs=64",
    "--dpo.generated_held_out=16",
    "--validation.batches=2",
    "--metrics.eval_freq=2",
    "--metrics.log_freq=1",
]
LAYOUTS = {"fsdp2": ["--parallelism.dp_shard=2"], "tp2": ["--parallelism.tp=2", "--parallelism.dp_shard=1"]}


def capture_first_gradients(trainer: Any) -> dict[str, torch.Tensor]:
    """Every trained parameter's full gradient as the optimizer's first step sees it (a collective:
    every rank gathers the same tensors in the same order)."""
    grads: dict[str, torch.Tensor] = {}

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if grads:
            return
        for name, param in trainer.model.named_parameters():
            if param.grad is None:  # frozen (a LoRA run's base)
                continue
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            grads[canonical_name(name)] = grad.detach().to("cpu", copy=True)

    trainer.optimizer.register_step_pre_hook(before_step)
    return grads


def run(dump: Path, overrides: list[str]) -> tuple[RunResult, dict[str, torch.Tensor]]:
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config("dpo_qwen3_debug", [*BASE, *overrides, f"--job.dump_folder={dump}"]))
    grads = capture_first_gradients(trainer)
    return train_and_capture(trainer), grads


def run_layout(name: str, out: Path) -> None:
    result, grads = run(out / name, LAYOUTS[name])
    if dist.get_rank() == 0:
        result.save(out / f"{name}.pt")
        torch.save(grads, out / f"{name}_grads.pt")


def reference(out: Path) -> tuple[RunResult, dict[str, torch.Tensor]]:
    return run(out / "single", [])


def main(results: Path) -> None:
    run_cases(results, [(name, functools.partial(run_layout, name, results.parent)) for name in LAYOUTS])


if __name__ == "__main__":
    main(Path(sys.argv[1]))
