"""Worker for the multi-turn GRPO layout test: `torchrun --nproc-per-node 2 grpo_episodes_worker.py OUT` (a folder holding records.jsonl).

A real `Trainer` runs multi-turn GRPO (`grpo_calculator_debug` with the test environment
tests/support/byte_sum_env.py) on the Qwen 3 debug flavor (2 layers, fp32) under FSDP 2: 2 rollouts of
4 prompts x 4 episodes, one optimizer step each, so the second rollout is sampled after an update. The
policy's head is set so that it ends a turn often (`favour_end_of_turn`): from random weights a turn
would almost never end and no episode would reach a second turn. The run (losses, gradient norms, the
final state) goes to OUT/fsdp2.pt, every rank's episodes of the last rollout to OUT/episodes.json;
`reference()` is the single process, run by the test.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402

from tests.support.launch import fixed_kernels  # noqa: E402
from tests.support.parity import RunResult, train_and_capture  # noqa: E402
from titan_tpu.config import load_config  # noqa: E402

STEPS = 2
RECORDS = [{"prompt": f"question {k}"} for k in range(24)]


def overrides(records: Path, dump: Path) -> list[str]:
    return [
        *fixed_kernels("grpo_calculator_debug"),
        "--model.overrides={ n_layers = 2 }",
        "--training.dtype=float32",
        f"--training.steps={STEPS}",
        "--training.seq_len=96",
        "--training.global_batch_size=16",
        "--rl.prompts_per_step=4",
        "--rl.group_size=4",
        "--rl.max_new_tokens=8",
        "--rl.env=tests.support.byte_sum_env:ByteSum",
        "--rl.eval_prompts=3",
        "--metrics.eval_freq=2",
        "--metrics.log_freq=1",
        "--optimizer.lr=1e-6",
        f"--data.path={records}",
        f"--job.dump_folder={dump}",
    ]


def favour_end_of_turn(model: torch.nn.Module, end_of_turn: int) -> None:
    """Shrink every row of the output head but the end-of-turn token's, which is set to a random
    direction of norm 8: its logit then varies widely with the context and wins about a fifth of the
    time, so turns end after a few tokens (the same change on every layout: the full weight is edited
    and sharded again)."""
    weight = model.output.weight  # type: ignore[union-attr]
    with torch.no_grad():
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight.detach().clone()
        direction = torch.randn(full.shape[1], generator=torch.Generator().manual_seed(0))
        full = full * 0.05
        full[end_of_turn] = 8 * direction / direction.norm()
        if isinstance(weight, DTensor):
            weight.copy_(distribute_tensor(full.to(weight.dtype), weight.device_mesh, weight.placements))
        else:
            weight.copy_(full)


def episodes_of(trainer: Any) -> dict[int, dict[str, Any]]:
    """Every rank's episodes of the last rollout: tokens, the model's mask, reward, turns, how it ended."""
    latest = trainer.task.source.episodes.latest
    mine = {
        row: {"tokens": e.tokens, "trained": e.trained, "reward": e.reward, "turns": e.turns, "end": e.end}
        for row, e in latest.items()
    }
    if not dist.is_initialized():
        return mine
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {row: episode for part in gathered for row, episode in part.items()}


def run(records: Path, dump: Path, extra: list[str]) -> tuple[RunResult, dict[int, dict[str, Any]]]:
    from titan_tpu.training.trainer import Trainer

    trainer = Trainer(load_config("grpo_calculator_debug", [*overrides(records, dump), *extra]))
    try:
        favour_end_of_turn(trainer.model, trainer.task.episodes.codec.end_of_turn_id)
        return train_and_capture(trainer), episodes_of(trainer)
    finally:
        trainer.close()


def write_records(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def reference(out: Path) -> tuple[RunResult, dict[int, dict[str, Any]]]:
    return run(out / "records.jsonl", out / "single", [])


def main(out: Path) -> None:
    result, episodes = run(out / "records.jsonl", out / "fsdp2", ["--parallelism.dp_shard=2"])
    if int(os.environ["RANK"]) == 0:
        result.save(out / "fsdp2.pt")
        (out / "episodes.json").write_text(json.dumps({str(row): e for row, e in episodes.items()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
