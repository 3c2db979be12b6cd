"""A reward that varies with the sampled text, for GRPO tests that start from random weights (where
the arithmetic reward is always 0, and so would every GRPO gradient be): the sum of a completion's
bytes modulo 5, scaled to [0, 1]. Used through the user-reward path, `rl.rewards = [{ fn =
"tests.support.token_sum_reward:token_sum" }]`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REWARDS = '--rl.rewards=[{ fn = "tests.support.token_sum_reward:token_sum" }]'


def token_sum(prompts: list[str], completions: list[str], records: list[Mapping[str, Any]]) -> list[float]:
    return [(sum(c.encode("utf-8", "replace")) % 5) / 4 for c in completions]
