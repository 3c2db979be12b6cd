"""GRPO learning run on a CPU: a debug-size Qwen 3 learns "a+b=c" from our own pretraining loop on
generated text whose demonstrations drop the carry on a share of problems, then GRPO with the exact-match
reward repairs it. Prints held-out exact-match accuracy (greedy) before and after GRPO.

    .venv/bin/python scripts/grpo_arithmetic.py --out /tmp/grpo_arith [--pretrain-steps N --grpo-steps N]

Both phases run through the one trainer (`train.py`'s path): pretraining as the language_model task on
the generated corpus, exported to a Hugging Face folder, which GRPO loads as checkpoint.initial_load_path.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.config.loader import load_config  # noqa: E402
from titan_tpu.tasks.grpo.arithmetic import ArithmeticProblems, pretraining_corpus  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402


def pretrain(out: Path, steps: int, carry_error_rate: float, max_operand: int) -> Path:
    """Train on the corpus and export the weights; returns the Hugging Face folder."""
    problems = ArithmeticProblems(max_operand, held_out_fraction=0.05)
    corpus = pretraining_corpus(
        problems, out / "corpus" / "arithmetic.txt", lines=200_000, carry_error_rate=carry_error_rate, seed=0
    )
    config = load_config(
        "qwen3_debug",
        [
            f"--job.dump_folder={out / 'pretrain'}",
            "--data.source=files",
            f"--data.path={corpus}",
            f"--training.steps={steps}",
            "--training.seq_len=64",
            "--training.global_batch_size=32",
            "--training.dtype=float32",
            "--optimizer.lr=3e-3",
            "--lr_scheduler.warmup_steps=10",
            f"--metrics.log_freq={max(1, steps // 5)}",
        ],
    )
    trainer = Trainer(config)
    try:
        records = trainer.train()
        folder = out / "pretrained_hf"
        export_model_to_hf(trainer.model, folder, trainer.spec.state_dict_adapter, trainer.model_args)
    finally:
        trainer.close()
    print(f"pretraining: {steps} steps, last loss {records[-1].loss:.4f}")
    return folder


def grpo(out: Path, initial: Path, steps: int, max_operand: int, extra: list[str]) -> dict[str, Any]:
    config = load_config(
        "grpo_qwen3_debug",
        [
            f"--job.dump_folder={out / 'grpo'}",
            f"--checkpoint.initial_load_path={initial}",
            f"--training.steps={steps}",
            f"--rl.max_operand={max_operand}",
            f"--metrics.eval_freq={steps}",
            *extra,
        ],
    )
    trainer = Trainer(config)
    try:
        before = trainer.evaluate()["heldout_accuracy"]
        print(f"held-out accuracy before GRPO: {100 * before:.1f}%")
        records = trainer.train()
    finally:
        trainer.close()
    after = records[-1].extras["heldout_accuracy"]
    rewards = [r.extras.get("reward_mean") for r in records]
    return {"before": before, "after": after, "rewards": rewards, "records": [r.to_dict() for r in records]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/grpo_arithmetic"))
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--grpo-steps", type=int, default=200)
    parser.add_argument("--carry-error-rate", type=float, default=0.7)
    parser.add_argument("--max-operand", type=int, default=99)
    args, extra = parser.parse_known_args()
    start = time.perf_counter()
    initial = pretrain(args.out, args.pretrain_steps, args.carry_error_rate, args.max_operand)
    result = grpo(args.out, initial, args.grpo_steps, args.max_operand, extra)
    result["seconds"] = time.perf_counter() - start
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(
        f"held-out accuracy: {100 * result['before']:.1f}% -> {100 * result['after']:.1f}% "
        f"({100 * (result['after'] - result['before']):+.1f} points) in {result['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
