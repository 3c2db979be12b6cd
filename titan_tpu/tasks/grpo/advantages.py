"""A rollout's advantages from its rewards (`rl.advantage_estimator`, `rl.scale_rewards`): one number
per completion, laid out group after group (the G completions of one prompt adjacent), the same on
every rank (the rewards are every rank's already).

- grpo: r - the group's mean, divided by the group's std (`group`, GRPO), by the std of every reward
  of the rollout (`batch`, TRL's scale_rewards="batch") or by nothing (`none`, Dr. GRPO); TRL's
  GRPOTrainer.
- rloo: r - the mean of the group's other completions (the leave-one-out baseline), optionally
  whitened over the rollout (`batch`); TRL's RLOOTrainer (normalize_advantages).
- reinforce_pp: no group baseline; each completion's reward as the return of every one of its
  tokens, whitened over all completion tokens of the rollout (mean and Bessel-corrected variance
  weighted by the tokens); verl's compute_reinforce_plus_plus_outcome_advantage with gamma = 1 and
  its constants (1e-8 beside each count and under the square root).
"""

from __future__ import annotations

from typing import Literal

import torch

from titan_tpu.tasks.grpo.objective import group_advantages

Estimator = Literal["grpo", "rloo", "reinforce_pp"]
Scaling = Literal["group", "batch", "none"]
_VERL_EPS = 1e-8  # verl's masked_mean and masked_whiten constants


def rollout_advantages(
    rewards: torch.Tensor,
    token_counts: torch.Tensor,
    group_size: int,
    estimator: Estimator,
    scaling: Scaling,
    eps: float,
) -> torch.Tensor:
    """rewards [N] and each completion's trained tokens [N] (reinforce_pp's weights) -> advantages [N]."""
    if estimator == "grpo":
        if scaling == "batch":
            centred = group_advantages(rewards, group_size, scale_by_std=False)
            return centred / (rewards.std() + eps)
        return group_advantages(rewards, group_size, scale_by_std=scaling == "group", eps=eps)
    if estimator == "rloo":
        return leave_one_out_advantages(rewards, group_size, whiten=scaling == "batch", eps=eps)
    if estimator == "reinforce_pp":
        return whitened_returns(rewards, token_counts)
    raise ValueError(f"estimator must be grpo, rloo or reinforce_pp, got {estimator!r}")


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int, whiten: bool, eps: float) -> torch.Tensor:
    """r_i - (sum of the group - r_i) / (G - 1); with `whiten`, then (A - mean A) / (std A + eps) over
    the rollout (TRL's RLOOTrainer, normalize_advantages)."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a leave-one-out baseline, got {group_size}")
    grouped = rewards.view(-1, group_size)
    baselines = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    advantages = (grouped - baselines).reshape(-1)
    if whiten:
        advantages = (advantages - advantages.mean()) / (advantages.std() + eps)
    return advantages


def whitened_returns(rewards: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ on outcome rewards: every token's return is its completion's reward (gamma = 1),
    whitened over all tokens: (r - mean) / sqrt(var + 1e-8), mean and unbiased var token-weighted."""
    weights = token_counts.to(rewards.dtype)
    tokens = weights.sum()
    if tokens <= 1:
        raise ValueError(f"reinforce_pp whitens over the rollout's tokens and needs at least 2, got {int(tokens)}")
    mean = (rewards * weights).sum() / (tokens + _VERL_EPS)
    variance = ((rewards - mean) ** 2 * weights).sum() / (tokens + _VERL_EPS) * tokens / (tokens - 1)
    return (rewards - mean) * torch.rsqrt(variance + _VERL_EPS)
