"""Preference training (DPO) from random weights on a CPU, nothing downloaded: a debug-size Qwen 3 learns
to prefer the right sum to a wrong answer on questions it never saw ("What is 37+45?": "82" over "8").

    .venv/bin/python scripts/recipes/dpo_preferences.py --out /tmp/dpo_preferences [--steps N ...]

1. Data: the generated sums of `titan_tpu/data/preference_generated.py` written as preference records
   (TRL's conversational shape: the prompt a user turn, chosen and rejected one assistant turn each):
   the chosen answer is the sum, the rejected one the difference of the two numbers or one of them
   repeated. Held-out pairs ask questions that no training pair asks.
2. DPO (`dpo_qwen3_debug`: the Qwen 3 debug flavor with 2 layers, the built-in ChatML byte tokenizer,
   the sigmoid loss with beta 0.1, a frozen copy of the initial model as the reference) in float32 on
   the records as files, as your own pairs would be read. No SFT: the policy starts from random weights.
3. The held-out reward accuracy (the share of held-out pairs whose chosen answer the policy's implicit
   reward, beta x log pi/ref, ranks strictly higher) before training, at every evaluation and at the
   end. Before training the policy is its reference, so every pair ties and the accuracy is 0.
4. The control (`--control-steps`, 0 to skip): the same run on the same pairs with chosen and rejected
   swapped at random, from which nothing about sums can be learned; its held-out accuracy stays near
   0.5, so a rise in the first run comes from the preferences.

The numbers (fractions) and the wall time go to `<out>/result.json`. Extra `--section.key=value`
arguments go to both runs.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.config import ConfigError, TrainConfig  # noqa: E402
from titan_tpu.config.loader import load_config  # noqa: E402
from titan_tpu.data.preference_generated import GeneratedPreferences, Split  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

PAIRS_PER_EVALUATION_BATCH = 16  # dpo_qwen3_debug's global batch


def write_pairs(path: Path, split: Split, count: int, swap_share: float) -> Path:
    """`count` generated pairs of `split` as .jsonl records; a share of them with chosen and rejected
    swapped (seeded)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    swaps = random.Random(f"dpo_preferences:{split}:{swap_share}")
    pairs = GeneratedPreferences(0, split, count)
    with path.open("w", encoding="utf-8") as handle:
        for index in range(count):
            record = pairs.record(index)
            if swaps.random() < swap_share:
                record["chosen"], record["rejected"] = record["rejected"], record["chosen"]
            handle.write(json.dumps(record) + "\n")
    return path


def config(
    out: Path, name: str, train: Path, held_out: Path, steps: int, args: argparse.Namespace, extra: list[str]
) -> TrainConfig:
    return load_config(
        "dpo_qwen3_debug",
        [
            f"--job.dump_folder={out / name}",
            "--training.dtype=float32",
            f"--training.steps={steps}",
            f"--metrics.eval_freq={args.eval_freq}",
            "--dpo.dataset=data",
            "--data.source=files",
            f"--data.path={train}",
            "--validation.source=files",
            f"--validation.path={held_out}",
            f"--validation.batches={args.held_out_pairs // PAIRS_PER_EVALUATION_BATCH}",
            *extra,
        ],
    )


def train(name: str, cfg: TrainConfig) -> dict[str, object]:
    """Held-out accuracy before training, at each evaluation and at the end, and the seconds trained."""
    trainer = Trainer(cfg)
    try:
        before = trainer.evaluate()
        start = time.perf_counter()
        records = trainer.train()
        seconds = time.perf_counter() - start
    finally:
        trainer.close()
    curve = [(r.step, r.extras["heldout_reward_accuracy"]) for r in records if "heldout_reward_accuracy" in r.extras]
    print(
        f"{name}: held-out reward accuracy {before['heldout_reward_accuracy']:.3f} before, "
        + ", ".join(f"{accuracy:.3f} at step {step}" for step, accuracy in curve)
        + f"; {cfg.training.steps} steps in {seconds:.0f} s"
    )
    return {"before": before["heldout_reward_accuracy"], "after": curve[-1][1], "curve": curve, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/dpo_preferences"))
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of 16 pairs")
    parser.add_argument("--control-steps", type=int, default=200, help="steps of the random-preference run; 0 = none")
    parser.add_argument("--train-pairs", type=int, default=4096)
    parser.add_argument("--held-out-pairs", type=int, default=512, help="a multiple of 16")
    parser.add_argument("--eval-freq", type=int, default=50)
    args, extra = parser.parse_known_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty; pick a new folder")
    for flag in ("steps", "train_pairs", "held_out_pairs", "eval_freq"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.control_steps < 0:
        parser.error(f"--control-steps must be >= 0, got {args.control_steps}")
    if args.held_out_pairs % PAIRS_PER_EVALUATION_BATCH:
        parser.error(f"--held-out-pairs must be a multiple of {PAIRS_PER_EVALUATION_BATCH}, got {args.held_out_pairs}")
    start = time.perf_counter()
    data = args.out / "data"
    held_out = write_pairs(data / "held_out.jsonl", "held_out", args.held_out_pairs, 0.0)
    runs = {
        "dpo": train(
            "dpo",
            config(
                args.out,
                "dpo",
                write_pairs(data / "train.jsonl", "train", args.train_pairs, 0.0),
                held_out,
                args.steps,
                args,
                extra,
            ),
        )
    }
    if args.control_steps:
        random_pairs = write_pairs(data / "random_preferences.jsonl", "train", args.train_pairs, 0.5)
        runs["control"] = train(
            "control", config(args.out, "control", random_pairs, held_out, args.control_steps, args, extra)
        )
    result: dict[str, object] = {**runs, "seconds": time.perf_counter() - start}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:  # a bad --section.key=value
        raise SystemExit(f"error: {error}") from None
