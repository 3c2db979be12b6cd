"""Pretrain, SFT and GRPO on a CPU, nothing downloaded: a debug-size Qwen 3 learns word problems with
worked solutions ("Ann has 7 apples and buys 5 more. ..." -> "7 + 5 = 12. #### 12").

    .venv/bin/python scripts/recipes/sft_then_grpo.py --out /tmp/sft_then_grpo [--pretrain-steps N ...]

1. Data: generated problems (titan_tpu/tasks/grpo/word_problems.py); a held-out split that no phase
   trains on. On a share of two-step problems (`--error-rate`) every demonstration, in the
   pretraining text and in the SFT conversations, gives the first step's result as the final answer:
   the model imitates that mistake when it decodes greedily, so SFT lands well below 100%, yet it
   still samples the right answer some of the time, which GRPO's `math` reward can find and repair.
2. Tokenizer: a byte-level BPE trained on the problems with `tokenizers`, saved with a ChatML template.
3. Pretrain (the language_model task on the plain problems and solutions), then SFT (the sft task on
   chat records, loss on the assistant turn), then GRPO (the grpo task on the same template's
   prompts, `rl.task = "data"`, the `math` reward through math-verify), all in fp32 through the one
   trainer; each phase starts from the previous phase's Hugging Face export.

After each phase the exported folder (`<out>/<phase>_hf`, tokenizer and template included) is
evaluated: held-out accuracy is the share of greedy answers the `math` reward accepts, and
transformers must greedy-decode the same tokens as our sampler on 16 held-out prompts. The accuracies
(fractions) and the wall time go to `<out>/result.json`. Extra `--section.key=value` arguments go to
the GRPO phase.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.config import ConfigError, TrainConfig  # noqa: E402
from titan_tpu.config.loader import load_config  # noqa: E402
from titan_tpu.data.bpe import SMALLEST_VOCAB, train_bpe  # noqa: E402
from titan_tpu.data.chat_tokenizer import tokenizer_export_files  # noqa: E402
from titan_tpu.tasks.grpo.recipe_eval import PhaseEvaluation, evaluate_export  # noqa: E402
from titan_tpu.tasks.grpo.word_problem_data import RecipeData, write_recipe_data  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

DEBUG_VOCAB = 512  # the qwen3 debug flavor's embedding rows
MODEL = ["--model.name=qwen3", "--model.flavor=debug", "--training.dtype=float32"]


@dataclass(frozen=True)
class PhaseRun:
    folder: Path  # the Hugging Face export, tokenizer included
    train_seconds: float  # `Trainer.train()` alone: no model build, weight loading or export


def run_phase(name: str, config: TrainConfig, out: Path) -> PhaseRun:
    """Train one phase and export it with the tokenizer."""
    start = time.perf_counter()
    trainer = Trainer(config)
    try:
        train_start = time.perf_counter()
        records = trainer.train()
        train_seconds = time.perf_counter() - train_start
        folder = out / f"{name}_hf"
        files = tokenizer_export_files(config.data.tokenizer)
        export_model_to_hf(
            trainer.model, folder, trainer.spec.state_dict_adapter, trainer.model_args, extra_files=files
        )
    finally:
        trainer.close()
    print(
        f"{name}: {config.training.steps} steps, last loss {records[-1].loss:.4f}, {time.perf_counter() - start:.0f} s"
    )
    return PhaseRun(folder, train_seconds)


def configs(args: argparse.Namespace, data: RecipeData, extra: list[str]) -> dict[str, TrainConfig]:
    out, tokenizer = args.out, f"--data.tokenizer={data.tokenizer}"
    pretrain = load_config(
        "qwen3_debug",
        [
            *MODEL,
            tokenizer,
            f"--job.dump_folder={out / 'pretrain'}",
            "--data.source=files",
            f"--data.path={data.pretraining}",
            f"--training.steps={args.pretrain_steps}",
            "--training.seq_len=128",
            "--training.global_batch_size=16",
            "--optimizer.lr=3e-3",
            "--lr_scheduler.warmup_steps=20",
            f"--metrics.log_freq={max(1, args.pretrain_steps // 5)}",
        ],
    )
    sft = load_config(
        "sft_qwen3_debug",
        [
            *MODEL,
            tokenizer,
            f"--job.dump_folder={out / 'sft'}",
            "--sft.dataset=data",
            "--data.source=files",
            f"--data.path={data.sft}",
            f"--checkpoint.initial_load_path={out / 'pretrain_hf'}",
            f"--training.steps={args.sft_steps}",
            "--training.seq_len=128",
            "--training.global_batch_size=16",
            "--optimizer.lr=1e-3",
            "--lr_scheduler.warmup_steps=10",
            "--validation.enable=false",
            "--sft.eval_generations=0",
            "--metrics.eval_freq=0",
            f"--metrics.log_freq={max(1, args.sft_steps // 5)}",
        ],
    )
    grpo = load_config(
        "grpo_qwen3_debug",
        [
            *MODEL,
            tokenizer,
            f"--job.dump_folder={out / 'grpo'}",
            "--rl.task=data",
            "--data.source=files",
            f"--data.path={data.prompts}",
            f"--rl.eval_path={data.held_out}",
            "--rl.prompt_field=question",
            "--rl.reference_field=answer",
            '--rl.rewards=[{ fn = "math" }]',
            f"--rl.max_new_tokens={args.max_new_tokens}",
            f"--rl.eval_prompts={args.eval_prompts}",
            f"--checkpoint.initial_load_path={out / 'sft_hf'}",
            f"--training.steps={args.grpo_steps}",
            "--training.seq_len=96",
            "--metrics.eval_freq=0",
            f"--metrics.log_freq={max(2, args.grpo_steps // 10)}",
            *extra,
        ],
    )
    return {"pretrain": pretrain, "sft": sft, "grpo": grpo}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/sft_then_grpo"))
    parser.add_argument("--pretrain-steps", type=int, default=400)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument(
        "--error-rate", type=float, default=0.7, help="share of two-step demonstrations that stop one step early"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=DEBUG_VOCAB, help="BPE vocabulary, bytes and special tokens included"
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--eval-prompts", type=int, default=256, help="held-out problems decoded greedily after each phase"
    )
    args, extra = parser.parse_known_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty; pick a new folder")
    for flag in ("pretrain_steps", "sft_steps", "grpo_steps", "max_new_tokens", "eval_prompts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.error_rate <= 1:
        parser.error(f"--error-rate must be in [0, 1], got {args.error_rate}")
    if not SMALLEST_VOCAB <= args.vocab_size <= DEBUG_VOCAB:
        parser.error(
            f"--vocab-size must be in [{SMALLEST_VOCAB}, {DEBUG_VOCAB}] (the debug flavor's vocabulary), got {args.vocab_size}"
        )
    start = time.perf_counter()
    data = write_recipe_data(args.out / "data", seed=0, error_rate=args.error_rate, held_out=args.eval_prompts)
    train_bpe(data.texts(), data.tokenizer, args.vocab_size)
    phases = configs(args, data, extra)
    accuracies: dict[str, float] = {}
    for name, config in phases.items():
        folder = run_phase(name, config, args.out).folder
        check: PhaseEvaluation = evaluate_export(folder, phases["grpo"])
        accuracies[name] = check.accuracy
        print(
            f"{name}: held-out accuracy {100 * check.accuracy:.1f}% ({check.evaluated} problems); "
            f"transformers decodes the same greedy tokens on {check.matching}/{check.compared} prompts"
        )
        if check.matching != check.compared:
            raise SystemExit(
                f"{folder}: transformers' greedy tokens differ from our sampler's on "
                f"{check.compared - check.matching} of {check.compared} held-out prompts"
            )
    result: dict[str, object] = {"phases": accuracies, "seconds": time.perf_counter() - start}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(
        f"held-out accuracy: pretrain {100 * accuracies['pretrain']:.1f}%, SFT {100 * accuracies['sft']:.1f}%, "
        f"GRPO {100 * accuracies['grpo']:.1f}% in {result['seconds']:.0f} s"
    )
    return result


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:  # a bad --section.key=value for the GRPO phase, or a phase's config
        raise SystemExit(f"error: {error}") from None
