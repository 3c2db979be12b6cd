"""Reward functions: (prompt, completion, reference) -> float, computed on decoded text.

A verifiable task scores a completion by checking it, not by a learned model. The completion text is
what the policy generated, including the stop text when it stopped on its own (so a format check can
tell a finished answer from one cut off at max_new_tokens).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class RewardFunction(Protocol):
    name: str

    def __call__(self, prompt: str, completion: str, reference: str) -> float: ...


@dataclass(frozen=True)
class ExactMatchReward:
    """1.0 when the completion, cut at the first stop text and stripped of white space, equals the
    reference answer; else 0.0."""

    stop_text: str = "\n"
    name: str = "exact_match"

    def __call__(self, prompt: str, completion: str, reference: str) -> float:
        answer = completion.split(self.stop_text, 1)[0] if self.stop_text else completion
        return 1.0 if answer.strip() == reference.strip() else 0.0


@dataclass(frozen=True)
class FormatReward:
    """1.0 when the whole completion is one answer in the expected shape followed by the stop text
    (for arithmetic: an optionally signed integer, then a newline); else 0.0. It rewards answering in
    the form the checker can read, right or wrong."""

    pattern: str = r"-?\d+"
    stop_text: str = "\n"
    name: str = "format"

    def __call__(self, prompt: str, completion: str, reference: str) -> float:
        return 1.0 if re.fullmatch(self.pattern + re.escape(self.stop_text), completion) else 0.0


@dataclass(frozen=True)
class WeightedRewards:
    """The sum of several rewards, each times its weight; `parts` also returns each one for metrics."""

    functions: Sequence[RewardFunction]
    weights: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.functions) != len(self.weights):
            raise ValueError(f"{len(self.functions)} reward functions but {len(self.weights)} weights")

    def parts(self, prompt: str, completion: str, reference: str) -> dict[str, float]:
        return {f.name: f(prompt, completion, reference) for f in self.functions}

    def total(self, parts: dict[str, float]) -> float:
        return sum(w * parts[f.name] for f, w in zip(self.functions, self.weights))
