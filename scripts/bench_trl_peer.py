"""GRPO against the peer a user would pick instead: TRL's `GRPOTrainer` (the installed TRL, sampling
with transformers' `generate`) and ours, from the same SFT policy, on the same work.

    .venv/bin/python scripts/bench_trl_peer.py --recipe OUT [--steps 30] [--out DIR]

OUT is a finished `scripts/recipes/sft_then_grpo.py --out OUT` run; both start from its SFT export
(`OUT/sft_hf`, tokenizer and chat template included) and train on its GRPO prompts in the order our
run takes them (TRL's dataset in that order, unshuffled), with the recipe's `math` reward (the same
function: TRL's completions are ours without the end-of-turn token, which the reward cuts anyway),
8 prompts x 8 completions per step (one optimizer step per rollout), 64 new tokens at temperature
1, the DAPO token-mean loss with clip 0.2 / 0.28 and no KL term, rewards scaled by the group's
standard deviation, AdamW at 3e-5 (betas 0.9 / 0.95, no weight decay, constant), gradient clipping
at 1.0, fp32, the machine's default threads for both. Ours runs eagerly and with
`compile.enable = true`. After each run, held-out accuracy of its model as the recipe measures it
(the same 256 problems, greedy).

Prints one JSON line per run (seconds per step: the whole `train()` over its steps, on each side
the training loop alone, without building the model or loading it; and the median step after the
first; held-out accuracy) and ours / TRL's seconds per step for each of ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

import torch  # noqa: E402

from scripts.bench_grpo_overlap import recipe_data  # noqa: E402
from scripts.recipes.sft_then_grpo import configs, run_phase  # noqa: E402
from titan_tpu.config import TrainConfig  # noqa: E402
from titan_tpu.data.tokenizer import build_tokenizer  # noqa: E402
from titan_tpu.tasks.grpo.config import RLConfig  # noqa: E402
from titan_tpu.tasks.grpo.prompts import PromptStream, prompt_set  # noqa: E402
from titan_tpu.tasks.grpo.recipe_eval import evaluate_export  # noqa: E402
from titan_tpu.tasks.grpo.rewards import build_rewards  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS, SEQ_LEN = 8, 8, 64, 160
RESULT_MARK = "result: "  # the line a run's process prints its result on


def our_config(recipe: Path, steps: int, dump: Path, compiled: bool) -> TrainConfig:
    phase_args = SimpleNamespace(out=recipe, grpo_steps=steps, max_new_tokens=NEW_TOKENS, eval_prompts=256)
    phase_args.pretrain_steps = phase_args.sft_steps = 1  # unused: only the GRPO phase runs here
    extra = [
        f"--rl.prompts_per_step={PROMPTS}",
        f"--rl.group_size={GROUP}",
        f"--training.global_batch_size={PROMPTS * GROUP}",
        f"--training.seq_len={SEQ_LEN}",
        f"--job.dump_folder={dump}",
        "--metrics.log_freq=1",
        f"--compile.enable={str(compiled).lower()}",
    ]
    return configs(phase_args, recipe_data(recipe), extra)["grpo"]


def run_ours(recipe: Path, steps: int, out: Path, compiled: bool) -> dict[str, Any]:
    name = "ours_compiled" if compiled else "ours_eager"
    config = our_config(recipe, steps, out / name, compiled)
    phase = run_phase(name, config, out)
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    step_seconds = [r["step_time_s"] for r in records if "loss" in r]
    return {
        "run": name,
        "steps": len(step_seconds),
        "seconds_per_step": round(phase.train_seconds / steps, 3),
        "median_step_after_first": round(statistics.median(step_seconds[1:]), 3),
        "heldout_accuracy": round(evaluate_export(phase.folder, config).accuracy, 4),
    }


def trl_dataset(config: TrainConfig, steps: int) -> tuple[list[dict[str, Any]], list[list[int]], str]:
    """Our run's prompts in its order: TRL's records (a user turn and the answer), our prompt ids, and
    the stop text our reward cuts completions at."""
    tokenizer = build_tokenizer(config.data.tokenizer)
    prompts = prompt_set(config, tokenizer)
    ours = PromptStream(prompts.train, config.training.seed).at(0, PROMPTS * steps)
    rl = config.section(RLConfig)  # our prompts are the template around each record's prompt field
    records = [{"prompt": [{"role": "user", "content": p.record[rl.prompt_field]}], **p.record} for p in ours]
    assert all(rl.reference_field in r for r in records)
    return records, [p.ids for p in ours], prompts.stop_text


def run_trl(recipe: Path, steps: int, out: Path) -> dict[str, Any]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = our_config(recipe, steps, out / "ours_for_trl", compiled=False)
    rl = config.section(RLConfig)
    records, our_ids, stop_text = trl_dataset(config, steps)
    folder = recipe / "sft_hf"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for record, ids in zip(records[:16], our_ids):  # the same prompt tokens on both sides
        theirs = tokenizer.apply_chat_template(
            record["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if list(theirs) != ids:
            raise SystemExit(f"TRL's prompt ids differ from ours: {list(theirs)} != {ids}")
    math = build_rewards(rl.rewards, rl.reference_field, stop_text)[0]

    def math_reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        texts = [c[0]["content"] for c in completions]
        rows = [{rl.reference_field: answer} for answer in columns[rl.reference_field]]
        return list(math.fn(["" for _ in texts], texts, rows))

    args = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        generation_batch_size=PROMPTS * GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",
        epsilon=rl.eps_low,
        epsilon_high=rl.eps_high,
        beta=0.0,
        scale_rewards="group",
        learning_rate=config.optimizer.lr,
        adam_beta1=config.optimizer.beta1,
        adam_beta2=config.optimizer.beta2,
        adam_epsilon=config.optimizer.eps,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=config.training.max_norm,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=config.training.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ends: list[float] = []

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[math_reward],
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    export = out / "trl_hf"
    trainer.save_model(str(export))
    tokenizer.save_pretrained(export)
    steps_seconds = [b - a for a, b in zip([start, *ends], ends)]
    return {
        "run": "trl",
        "steps": len(ends),
        "seconds_per_step": round(wall / steps, 3),
        "median_step_after_first": round(statistics.median(steps_seconds[1:]), 3),
        "heldout_accuracy": round(evaluate_export(export, config).accuracy, 4),
    }


RUNS = {
    "trl": run_trl,
    "ours_eager": lambda recipe, steps, out: run_ours(recipe, steps, out, compiled=False),
    "ours_compiled": lambda recipe, steps, out: run_ours(recipe, steps, out, compiled=True),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, required=True, help="a finished sft_then_grpo.py --out folder")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_trl_peer"))
    parser.add_argument("--run", choices=list(RUNS), help="one run in this process (the script starts one per run)")
    opts = parser.parse_args(argv)
    if opts.run is not None:
        result = RUNS[opts.run](opts.recipe, opts.steps, opts.out)
        print(RESULT_MARK + json.dumps({**result, "threads": torch.get_num_threads()}), flush=True)
        return 0
    if opts.out.exists() and any(opts.out.iterdir()):
        raise SystemExit(f"error: --out {opts.out} exists and is not empty; pick a new folder")
    opts.out.mkdir(parents=True, exist_ok=True)
    # Each run in a fresh process: one after another in a single process, ours ran 1.2x slower
    # after TRL's run than alone (state that transformers' Trainer leaves behind).
    results = []
    for run in RUNS:
        command = [sys.executable, __file__, *argv, "--run", run]
        output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        line = next(line for line in output.splitlines() if line.startswith(RESULT_MARK))
        results.append(json.loads(line[len(RESULT_MARK) :]))
        print(json.dumps(results[-1]), flush=True)
    trl = results[0]["seconds_per_step"]
    print(json.dumps({r["run"] + "_over_trl": round(r["seconds_per_step"] / trl, 2) for r in results[1:]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
