"""One measure for every phase of a recipe: an exported Hugging Face folder, prompted with a GRPO
config's held-out prompts (its template, stop tokens and first reward), greedy-decoded by our sampler
and scored as GRPO's held-out accuracy scores it; and transformers' greedy tokens for the first
`compared` prompts against ours (hf_greedy.py).

Scoring the exported folder rather than the live model also checks the export: a phase whose
folder lost a weight scores as badly as the folder does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_tpu.config import TrainConfig
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.hf_greedy import greedy_ours, greedy_transformers, load_exported
from titan_tpu.tasks.grpo.prompts import prompt_set, stop_ids
from titan_tpu.tasks.grpo.rewards import Completions, build_rewards, score
from titan_tpu.tasks.grpo.user_code import search_folders

COMPARED = 16


@dataclass(frozen=True)
class PhaseEvaluation:
    accuracy: float  # share of held-out problems whose greedy answer the first reward accepts
    evaluated: int
    matching: int  # of the compared prompts, those transformers answers with our exact tokens
    compared: int


def evaluate_export(folder: Path, config: TrainConfig, compared: int = COMPARED) -> PhaseEvaluation:
    rl = config.section(RLConfig)
    tokenizer = build_tokenizer(config.data.tokenizer)
    prompts = prompt_set(config, tokenizer)
    held_out = prompts.held_out[: rl.eval_prompts or None]
    stops = stop_ids(tokenizer, prompts.stop_text)
    ids = [p.ids for p in held_out]
    model, decoding = load_exported(folder, config.model.name, config.model.flavor)
    ours = greedy_ours(model, decoding, ids, rl.max_new_tokens, stops, tokenizer.eos_id)
    first = build_rewards(rl.rewards, rl.reference_field, prompts.stop_text, search_folders(config))[0]
    batch = Completions(
        [p.text for p in held_out],
        [tokenizer.decode(o) for o in ours],
        [p.record for p in held_out],
        [p.place for p in held_out],
    )
    correct = sum(score([first], batch)[first.name])
    theirs = greedy_transformers(folder, ids[:compared], rl.max_new_tokens, stops, tokenizer.eos_id)
    matching = sum(a == b for a, b in zip(ours[:compared], theirs))
    return PhaseEvaluation(correct / len(held_out), len(held_out), matching, len(theirs))
