"""The GRPO objective on per-token log-probabilities: group-normalised advantages, the clipped
importance ratio against the rollout policy, the k3 KL estimate against a frozen reference, and the
three ways of aggregating per-token losses into one number.

Shapes: B completions of up to T tokens; `mask` [B, T] is 1 on completion tokens that count (the stop
token included, padding excluded). Everything is element-wise, so the same code runs in float32 on the
accelerator and in float64 in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# token_mean: every completion token of the mini-batch weighs the same (DAPO); long answers dominate.
# seq_mean_token_mean: mean over each completion's tokens, then over completions (the GRPO paper);
#   a token of a short answer weighs more than one of a long answer.
# seq_mean_token_sum_norm: each completion's token sum divided by a constant (the longest allowed
#   completion), then mean over completions (Dr. GRPO); no length bias from the normaliser.
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """rewards [N] laid out group after group (G completions of one prompt are adjacent) -> advantages [N].

    A = r - mean(group), divided by (std(group) + eps) when `scale_by_std` (GRPO); Dr. GRPO leaves the
    std out because it up-weights groups that are nearly all right or all wrong. The std is the
    unbiased (Bessel-corrected) one, as in the GRPO paper's reference implementations. A group whose
    rewards are all equal gets zero advantage either way: it carries no learning signal.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to form a baseline, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled from the policy:
    exp(ref - logp) - (ref - logp) - 1, which is unbiased, never negative and low-variance."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


@dataclass
class GRPOLossTerms:
    """The loss (with gradient) and, detached, what the step record reports about it."""

    loss: torch.Tensor
    kl: torch.Tensor  # mean k3 KL over completion tokens (0 when beta = 0)
    clip_fraction: torch.Tensor  # share of completion tokens whose clipped term was the active one
    tokens: torch.Tensor  # completion tokens counted


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: LossAggregation,
    max_completion_tokens: int,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    token_normaliser: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> GRPOLossTerms:
    """Clipped surrogate loss of one micro-batch.

    logps: [B, T] log-probabilities of the sampled tokens under the policy being trained (with grad);
    old_logps: the same under the policy that sampled them (detached); advantages: [B], one per
    completion. The per-token loss is -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    + beta * k3_kl, aggregated by `aggregation`.

    `token_normaliser` (token_mean only): the divisor standing for "all completion tokens of the
    mini-batch", i.e. its token count / (micro-batches x data-parallel ranks). The trainer averages the
    micro-batch losses and the ranks' gradients, so with it the result is the token mean over the whole
    mini-batch even when micro-batches hold different numbers of tokens. None: this micro-batch's count.

    `token_weights` [B, T] (detached): truncated importance weights of the rollout engine's sampling
    against the trainer's policy, multiplying each token's clipped term before the KL term is added
    (TRL's `vllm_importance_sampling_correction`, token_truncate).
    """
    if aggregation not in LOSS_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(LOSS_AGGREGATIONS)}, got {aggregation!r}")
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype).unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    if token_weights is not None:
        per_token = per_token * token_weights.to(per_token.dtype)
    kl = torch.zeros_like(per_token)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference policy's log-probabilities (ref_logps)")
        kl = k3_kl(logps, ref_logps)
        per_token = per_token + beta * kl

    tokens = mask.sum()
    if aggregation == "token_mean":
        normaliser = tokens if token_normaliser is None else token_normaliser
        loss = (per_token * mask).sum() / torch.clamp(torch.as_tensor(normaliser, dtype=logps.dtype), min=1.0)
    elif aggregation == "seq_mean_token_mean":
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    else:
        loss = ((per_token * mask).sum(dim=1) / max_completion_tokens).mean()

    with torch.no_grad():
        is_clipped = ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))
        count = tokens.clamp(min=1.0)
        clip_fraction = (is_clipped.to(mask.dtype) * mask).sum() / count
        kl_mean = (kl.detach() * mask).sum() / count
    return GRPOLossTerms(loss=loss, kl=kl_mean, clip_fraction=clip_fraction, tokens=tokens.detach())
