"""Worker for the fine-tuning layout tests: `torchrun --nproc-per-node 4 sft_worker.py OUT`.

For each layout (FSDP 4 accumulating 2 micro-batches, TP 2 x FSDP 2 accumulating 2 micro-batches)
a real `Trainer` fine-tunes the Qwen 3 debug flavor on the generated conversations
(`sft_qwen3_debug`): packed rows with document masking, loss on the assistant turns, 6 fp32 steps,
the held-out loss at steps 3 and 6. The per-step losses and gradient norms, the held-out losses and
the full final state (parity.RunResult) go to OUT's folder/<layout>.pt; `reference()` is the single
process (one micro-batch per step), run by the test.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402

from tests.distributed.worker_cases import run_cases  # noqa: E402
from tests.support.launch import fixed_kernels  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402

STEPS = 6
BASE = [
    *fixed_kernels("sft_qwen3_debug"),
    "--training.seq_len=128",
    "--training.global_batch_size=4",
    "--training.dtype=float32",
    f"--training.steps={STEPS}",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.eval_freq=3",
    "--sft.generated_examples=256",
    "--sft.generated_held_out=64",
    "--sft.eval_generations=0",
    "--validation.batches=2",
    "--data.shuffle_buffer=8",
]
LAYOUTS: dict[str, list[str]] = {
    # 4 rows per step over 4 ranks would leave one row per rank: one micro-batch of 1 is the only
    # split, so FSDP 4 runs global 8 rows in 2 micro-batches of 1 against a single process's 8 in one.
    "fsdp4_accum2": ["--parallelism.dp_shard=4", "--training.global_batch_size=8", "--training.local_batch_size=1"],
    "tp2_fsdp2_accum2": ["--parallelism.tp=2", "--parallelism.dp_shard=2", "--training.local_batch_size=1"],
}
# The single-process run each layout is compared with: the same global batch in one micro-batch.
REFERENCE_OF = {"fsdp4_accum2": ["--training.global_batch_size=8"], "tp2_fsdp2_accum2": []}


def run_layout(name: str, overrides: list[str], dump: Path) -> dict:
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config("sft_qwen3_debug", [*BASE, *overrides, f"--job.dump_folder={dump / name}"]))
    run = train_and_capture(trainer)
    if dist.get_rank() == 0:
        run.save(dump / f"{name}.pt")
    return {}  # the test reads the run from the .pt file


def reference(dump: Path) -> dict[str, RunResult]:
    from titan_tpu.training.trainer import Trainer

    runs = {}
    for name, overrides in REFERENCE_OF.items():
        trainer = Trainer(
            load_config("sft_qwen3_debug", [*BASE, *overrides, f"--job.dump_folder={dump / ('single_' + name)}"])
        )
        runs[name] = train_and_capture(trainer)
        trainer.close()
    return runs


def main(out: Path) -> None:
    run_cases(
        out, [(name, functools.partial(run_layout, name, overrides, out.parent)) for name, overrides in LAYOUTS.items()]
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
