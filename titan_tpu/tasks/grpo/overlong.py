"""DAPO's soft overlong punishment (rl.overlong_buffer, rl.overlong_penalty): a completion is not
rewarded for being short, but one that runs into the last `buffer` tokens before the longest allowed
loses reward linearly, up to `penalty` at the limit (DAPO eq. 13; TRL's get_soft_overlong_punishment
with penalty 1; verl's DAPO reward manager's overlong_buffer with penalty_factor). A completion never
passes rl.max_new_tokens here (the sampler stops it), so the formula's -1 past the limit is its value
at the limit."""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalties(lengths: Sequence[float], max_tokens: int, buffer: int, penalty: float) -> list[float]:
    """The reward each completion of `lengths` tokens (its stop token included) gets added: 0 up to
    max_tokens - buffer tokens, then -penalty x (length - (max_tokens - buffer)) / buffer."""
    if buffer <= 0:
        raise ValueError(f"buffer must be > 0 tokens, got {buffer}")
    expected = max_tokens - buffer
    return [-penalty * min(max(length - expected, 0.0), float(buffer)) / buffer for length in lengths]
