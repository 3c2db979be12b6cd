"""A debug-size Qwen 3 learns to use a calculator tool on a CPU, nothing downloaded: three-digit products
it cannot work out by itself ("What is 347 * 829?" -> 287663).

    .venv/bin/python scripts/recipes/calculator_tool_use.py --out /tmp/calculator_tool_use [--sft-steps N ...]

1. Data: generated products of two three-digit numbers; a held-out set that no phase trains on. A few
   demonstrations for SFT (`messages` records with `tools`): 40% call the tool (the question, the call
   `calculator({"expression": "347 * 829"})`, the tool's result, the answer), 60% answer straight away
   with an estimate (the operands rounded to hundreds: close, never right; `--estimate-rate`), so the
   SFT model often estimates when it decodes greedily but calls the tool in many of its samples,
   which GRPO's reward can find and reinforce. Prompt records for GRPO (`prompt`, `answer`).
2. Tokenizer: a byte-level BPE trained on the rendered conversations with `tokenizers` (digits one by
   one), saved with `chatml_bytes`'s tool-capable ChatML template, its tool offer cut to one line
   ("Tools: calculator"; `COMPACT_TEMPLATE`): Qwen 3's offer (instructions and the JSON schema) would
   be three quarters of every sequence, and what the model must learn is the call, not the offer.
3. SFT from random weights on the demonstrations (loss on the assistant turns: the call and the
   answer, not the tool's result), then GRPO with the calculator environment (`rl.env = "calculator"`,
   up to 3 turns an episode, reward 1 for the right final answer), from the SFT model's export.

After each phase the exported folder is scored on the held-out problems as greedy episodes: with the
calculator offered, and without it (the environment offers no tool and answers any call with an
error) as the baseline of what the model does by itself. The accuracies (fractions) and the wall time
go to `<out>/result.json`. Extra `--section.key=value` arguments go to the GRPO phase.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from titan_tpu.device.tpu_runtime import skip_tpu_backend_without_chips  # noqa: E402

skip_tpu_backend_without_chips()  # before anything imports torch (titan_tpu/device/tpu_runtime.py)

from titan_tpu.checkpoint.hf_export import export_model_to_hf  # noqa: E402
from titan_tpu.config import ConfigError, TrainConfig  # noqa: E402
from titan_tpu.config.loader import load_config  # noqa: E402
from titan_tpu.data.bpe import train_bpe  # noqa: E402
from titan_tpu.data.chat_template import ChatTemplate  # noqa: E402
from titan_tpu.data.chat_tokenizer import CHATML_TEMPLATE, tokenizer_export_files  # noqa: E402
from titan_tpu.environments.calculator import Calculator  # noqa: E402
from titan_tpu.tasks.grpo.episode_eval import EpisodeEvaluation, evaluate_episodes  # noqa: E402
from titan_tpu.training.trainer import Trainer  # noqa: E402

DEBUG_VOCAB = 512  # the qwen3 debug flavor's embedding rows
MODEL = ["--model.name=qwen3", "--model.flavor=debug", "--training.dtype=float32"]
LOW, HIGH = 100, 999  # the operands: three digits each


# chatml_bytes's tool template with the offer in one line: the calls, tool results and turns unchanged.
QWEN3_OFFER = CHATML_TEMPLATE[
    CHATML_TEMPLATE.index('    {{- "# Tools') : CHATML_TEMPLATE.index("{%- elif messages[0].role")
]
COMPACT_TEMPLATE = CHATML_TEMPLATE.replace(
    QWEN3_OFFER,
    """    {{- 'Tools:' }}
    {%- for tool in tools %}
        {{- ' ' + tool.function.name }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
""",
)


@dataclass(frozen=True)
class RecipeData:
    sft: Path
    prompts: Path
    held_out: Path
    tokenizer: Path


Problem = tuple[str, int, int]  # the question and its operands


def problem(rng: random.Random) -> Problem:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    return f"What is {a} * {b}?", a, b


def demonstration(question: str, a: int, b: int, estimate: bool) -> dict[str, object]:
    """The question, the call, the tool's result and the answer; or, when `estimate`, an answer
    written straight away from the operands rounded to hundreds (close, never exact for these)."""
    tools = Calculator().start({"prompt": question, "answer": str(a * b)}).tools
    if estimate:
        guess = str(round(a, -2) * round(b, -2))
        return {
            "tools": tools,
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": guess}],
        }
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
    return {
        "tools": tools,
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ],
    }


def write_data(
    folder: Path, demonstrations: int, estimate_rate: float, prompts: int, held_out: int, vocab: int
) -> RecipeData:
    """Problems drawn without repeats, so the held-out ones are never trained on."""
    folder.mkdir(parents=True)
    rng = random.Random(0)
    seen: set[str] = set()
    problems: list[Problem] = []
    while len(problems) < demonstrations + prompts + held_out:
        item = problem(rng)
        if item[0] not in seen:
            seen.add(item[0])
            problems.append(item)
    estimates = set(rng.sample(range(demonstrations), round(estimate_rate * demonstrations)))
    sft = [demonstration(*p, estimate=k in estimates) for k, p in enumerate(problems[:demonstrations])]
    records: list[dict[str, object]] = [{"prompt": q, "answer": str(a * b)} for q, a, b in problems[demonstrations:]]
    data = RecipeData(folder / "sft.jsonl", folder / "prompts.jsonl", folder / "held_out.jsonl", folder / "tokenizer")
    _write_jsonl(data.sft, sft)
    _write_jsonl(data.prompts, records[:prompts])
    _write_jsonl(data.held_out, records[prompts:])
    # The tokenizer learns the rendered conversations, tool offers and calls included, so they stay short.
    template = ChatTemplate(COMPACT_TEMPLATE, {}, "the recipe's template")
    texts = [template.render(d["messages"], tools=d["tools"]) for d in sft]  # type: ignore[arg-type]
    train_bpe(texts, data.tokenizer, vocab)
    # Beside tokenizer_config.json's template, read first by ChatTemplate and by transformers.
    (data.tokenizer / "chat_template.jinja").write_text(COMPACT_TEMPLATE, encoding="utf-8")
    return data


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def run_phase(name: str, config: TrainConfig, out: Path) -> Path:
    """Train one phase and export it with the tokenizer."""
    start = time.perf_counter()
    trainer = Trainer(config)
    try:
        records = trainer.train()
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
    return folder


def configs(args: argparse.Namespace, data: RecipeData, extra: list[str]) -> dict[str, TrainConfig]:
    out, tokenizer = args.out, f"--data.tokenizer={data.tokenizer}"
    sft = load_config(
        "sft_qwen3_debug",
        [
            *MODEL,
            tokenizer,
            f"--job.dump_folder={out / 'sft'}",
            "--sft.dataset=data",
            "--data.source=files",
            f"--data.path={data.sft}",
            f"--training.steps={args.sft_steps}",
            "--training.seq_len=256",
            "--training.global_batch_size=16",
            "--optimizer.lr=3e-3",
            "--lr_scheduler.warmup_steps=10",
            "--validation.enable=false",
            "--sft.eval_generations=0",
            "--metrics.eval_freq=0",
            f"--metrics.log_freq={max(1, args.sft_steps // 5)}",
        ],
    )
    grpo_args = [
        *MODEL,
        tokenizer,
        f"--job.dump_folder={out / 'grpo'}",
        f"--data.path={data.prompts}",
        f"--rl.eval_path={data.held_out}",
        f"--rl.max_new_tokens={args.max_new_tokens}",
        f"--rl.eval_prompts={args.eval_prompts}",
        f"--checkpoint.initial_load_path={out / 'sft_hf'}",
        f"--training.steps={args.grpo_steps}",
        "--training.seq_len=192",  # a 3-turn episode of this template
        f"--optimizer.lr={args.grpo_lr}",
        "--metrics.eval_freq=0",
        f"--metrics.log_freq={max(2, args.grpo_steps // 10)}",
    ]
    grpo = load_config("grpo_calculator_debug", [*grpo_args, *extra])
    without_tool = load_config("grpo_calculator_debug", [*grpo_args, "--rl.env_args={ offer_tools = false }", *extra])
    return {"sft": sft, "grpo": grpo, "without_tool": without_tool}


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/calculator_tool_use"))
    parser.add_argument("--demonstrations", type=int, default=512, help="conversations for SFT")
    parser.add_argument(
        "--estimate-rate", type=float, default=0.6, help="share of the demonstrations that estimate instead of calling"
    )
    parser.add_argument("--prompts", type=int, default=4000, help="GRPO's training problems")
    parser.add_argument("--sft-steps", type=int, default=250)
    parser.add_argument("--grpo-steps", type=int, default=150)
    parser.add_argument("--grpo-lr", type=float, default=1e-4)
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens of one model turn")
    parser.add_argument("--eval-prompts", type=int, default=200, help="held-out problems, scored after each phase")
    args, extra = parser.parse_known_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out} exists and is not empty; pick a new folder")
    for flag in ("demonstrations", "prompts", "sft_steps", "grpo_steps", "max_new_tokens", "eval_prompts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    start = time.perf_counter()
    if not 0 <= args.estimate_rate < 1:
        parser.error(f"--estimate-rate must be in [0, 1), got {args.estimate_rate}")
    data = write_data(
        args.out / "data", args.demonstrations, args.estimate_rate, args.prompts, args.eval_prompts, DEBUG_VOCAB
    )
    phases = configs(args, data, extra)
    accuracies: dict[str, float] = {}
    for name in ("sft", "grpo"):
        folder = run_phase(name, phases[name], args.out)
        for offered, config in (("with_tool", phases["grpo"]), ("without_tool", phases["without_tool"])):
            check: EpisodeEvaluation = evaluate_episodes(folder, config)
            accuracies[f"{name}/{offered}"] = check.accuracy
            print(
                f"{name}, {offered.replace('_', ' ')}: held-out accuracy {100 * check.accuracy:.1f}% "
                f"({check.evaluated} problems; per episode {check.turns:.2f} turns, {check.tool_calls:.2f} tool "
                f"calls, {check.tool_errors:.2f} tool errors)"
            )
    result: dict[str, object] = {"accuracy": accuracies, "seconds": time.perf_counter() - start}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(
        f"held-out accuracy with the calculator: SFT {100 * accuracies['sft/with_tool']:.1f}%, GRPO "
        f"{100 * accuracies['grpo/with_tool']:.1f}%; without it: SFT {100 * accuracies['sft/without_tool']:.1f}%, "
        f"GRPO {100 * accuracies['grpo/without_tool']:.1f}%; {result['seconds']:.0f} s"
    )
    return result


if __name__ == "__main__":
    try:
        main()
    except ConfigError as error:  # a bad --section.key=value for the GRPO phase, or a phase's config
        raise SystemExit(f"error: {error}") from None
