"""The files of the word-problem recipe (scripts/recipes/sft_then_grpo.py), one per phase, as the
trainer reads them: pretraining text (`{"text": question + solution}`, one document per problem),
SFT conversations (`{"messages": [user, assistant]}`), GRPO prompts and held-out problems
(`{"question", "answer"}`, the GSM8K fields). The training files draw from the training split only.

`error_rate` is the share of two-step demonstrations (pretraining and SFT alike) whose final answer
stops one step early (word_problems.py); GRPO's prompts carry only the true answer, and the
held-out problems are never demonstrated.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

from titan_tpu.tasks.grpo.word_problems import WordProblem, problems

HELD_OUT_SHARE = 0.05


@dataclass(frozen=True)
class RecipeData:
    pretraining: Path
    sft: Path
    prompts: Path
    held_out: Path
    tokenizer: Path  # the folder the BPE tokenizer is trained into

    def texts(self) -> Iterator[str]:
        """What the tokenizer learns from: the pretraining text and the SFT conversations' turns."""
        for path, fields in ((self.pretraining, ("text",)), (self.sft, ("messages",))):
            for line in path.read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                for field in fields:
                    value = record[field]
                    yield from (turn["content"] for turn in value) if isinstance(value, list) else (value,)


def _write(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def _demonstrated(
    stream: Iterator[WordProblem], count: int, error_rate: float, rng: random.Random
) -> Iterator[tuple[str, str]]:
    for problem in islice(stream, count):
        yield problem.question, problem.solution(forget_last_step=rng.random() < error_rate)


def write_recipe_data(
    folder: Path,
    seed: int,
    error_rate: float,
    held_out: int,
    pretraining_docs: int = 50_000,
    sft_examples: int = 10_000,
    grpo_prompts: int = 5_000,
) -> RecipeData:
    if not 0 <= error_rate <= 1:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train = problems("train", seed, HELD_OUT_SHARE)
    pretraining = _write(
        folder / "pretraining.jsonl",
        ({"text": f"{q}\n{s}"} for q, s in _demonstrated(train, pretraining_docs, error_rate, rng)),
    )
    conversations = (
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": s}]}
        for q, s in _demonstrated(train, sft_examples, error_rate, rng)
    )
    sft = _write(folder / "sft.jsonl", conversations)
    prompts = _write(
        folder / "grpo_prompts.jsonl",
        ({"question": p.question, "answer": p.answer} for p in islice(train, grpo_prompts)),
    )
    evaluation = problems("held_out", seed, HELD_OUT_SHARE)
    held = _write(
        folder / "held_out.jsonl", ({"question": p.question, "answer": p.answer} for p in islice(evaluation, held_out))
    )
    return RecipeData(pretraining, sft, prompts, held, folder / "tokenizer")
