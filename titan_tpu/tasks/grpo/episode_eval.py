"""Held-out accuracy of an exported Hugging Face folder on multi-turn episodes: the folder's weights in
our model, a GRPO config's environment (rl.env, rl.env_args) and held-out records, greedy episodes
with the builtin sampler, and the environment's mean reward. A recipe measures each phase with it, the
environment built as the config says (with its tools, or without them for the no-tool baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from titan_tpu.config import TrainConfig
from titan_tpu.data.tokenizer import build_tokenizer
from titan_tpu.generation.builtin import BuiltinEngine
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.tasks.grpo.config import RLConfig
from titan_tpu.tasks.grpo.hf_greedy import load_exported
from titan_tpu.tasks.grpo.multi_turn import EpisodeSource
from titan_tpu.tasks.grpo.prompts import stop_ids


@dataclass(frozen=True)
class EpisodeEvaluation:
    accuracy: float  # the environment's mean reward over the held-out episodes
    evaluated: int
    turns: float  # per episode
    tool_calls: float
    tool_errors: float


@torch.no_grad()
def evaluate_episodes(folder: Path, config: TrainConfig) -> EpisodeEvaluation:
    rl = config.section(RLConfig)
    tokenizer = build_tokenizer(config.data.tokenizer)
    source = EpisodeSource(config, tokenizer)
    held_out = source.prompt_set(config).held_out[: rl.eval_prompts or None]
    model, decoding = load_exported(folder, config.model.name, config.model.flavor)
    engine = BuiltinEngine(decoding, tokenizer.eos_id, torch.device("cpu"), lambda group: True)
    engine.load_weights(model, version=0)
    params = SamplingParams(rl.max_new_tokens, temperature=0.0, stop_ids=stop_ids(tokenizer, source.codec.end_of_turn))
    episodes = source.greedy(engine.generate, held_out, params)
    count = len(episodes)
    return EpisodeEvaluation(
        accuracy=sum(e.reward for e in episodes) / count,
        evaluated=count,
        turns=sum(e.turns for e in episodes) / count,
        tool_calls=sum(e.tool_calls for e in episodes) / count,
        tool_errors=sum(e.tool_errors for e in episodes) / count,
    )
