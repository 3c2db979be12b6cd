"""What anything that samples asks of a rollout engine: token ids in, completion token ids and the
log-probabilities of the policy that drew them out, and a way to give it the current weights.

GRPO's rollouts and evaluation and SFT's generated answers go through it; the builtin KV-cached
sampler (titan_tpu/generation/builtin.py) is one engine. Token ids never make a text round trip, so
an engine cannot retokenise a completion into other ids than the ones it sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 decodes greedily; top_p 1 keeps the whole distribution; a completion ends at any
    of `stop_ids` (included) or after `max_new_tokens`."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Rollout:
    """One completion per prompt, in the prompts' order: its token ids (through its stop token, when
    it stopped), each token's log-probability under the sampling policy's own distribution before
    temperature and top-p (float32, on the host: what a training forward's log-softmax gives, GRPO's
    behaviour log-probabilities), and whether it stopped by itself."""

    tokens: list[list[int]]
    logps: list[torch.Tensor]
    stopped: list[bool]


class RolloutEngine(Protocol):
    """Samples completions of token-id prompts from a policy."""

    def load_weights(self, policy: nn.Module, version: int) -> None:
        """Sample from `policy`'s weights from now on; `version` counts the optimizer steps behind them."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> Rollout:
        """Complete every prompt. `seeds` (one per prompt) make sampling at temperature > 0
        reproducible row by row; greedy decoding ignores them."""
        ...

    def describe(self) -> str:
        """What the engine is, for the log: its kind and the weights version it samples from."""
        ...
