"""The GRPO objective on per-token log-probabilities: group-normalised advantages, the importance
ratio against the rollout policy (per token, or per sequence as GSPO), the clipped surrogate or
CISPO's clipped-weight objective, the k3 KL estimate against a frozen reference, and the three ways
of aggregating per-token losses into one number.

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
# clipped: PPO's clipped surrogate (GRPO, DAPO, GSPO). cispo: the ratio's weight is clipped and detached,
#   and multiplies A x log p (MiniMax-M1), so a token past the clip still has a gradient.
Objective = Literal["clipped", "cispo"]
# token: a ratio per token. sequence: GSPO's exp(mean over the completion's tokens of logp - old logp),
#   the same for every token of the completion.
ImportanceLevel = Literal["token", "sequence"]


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
    clip_fraction: torch.Tensor  # share of completion tokens whose clip was active (cispo: weight capped)
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
    objective: Objective = "clipped",
    cispo_cap: float = 5.0,
    importance_level: ImportanceLevel = "token",
) -> GRPOLossTerms:
    """Policy-gradient loss of one micro-batch.

    logps: [B, T] log-probabilities of the sampled tokens under the policy being trained (with grad);
    old_logps: the same under the policy that sampled them (detached); advantages: [B], one per
    completion. The per-token loss is -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
    + beta * k3_kl, aggregated by `aggregation`. With `objective = "cispo"` it is
    -sg(min(ratio, cispo_cap)) * A * logps instead (TRL's loss_type "cispo": its epsilon_high is the
    cap). `importance_level = "sequence"`: the ratio of every token of a completion is GSPO's
    exp(mean over its masked tokens of logps - old_logps), as TRL's importance_sampling_level forms it.

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
    log_ratio = logps - old_logps
    if importance_level == "sequence":
        # [B, 1], broadcast over the tokens; positions outside the mask (prompt, padding) carry no ratio.
        log_ratio = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    elif importance_level != "token":
        raise ValueError(f"importance_level must be 'token' or 'sequence', got {importance_level!r}")
    ratio = torch.exp(log_ratio)
    if objective == "cispo":
        weight = torch.clamp(ratio, max=cispo_cap).detach()
        per_token = -weight * advantages * logps
    elif objective == "clipped":
        clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    else:
        raise ValueError(f"objective must be 'clipped' or 'cispo', got {objective!r}")
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
        if objective == "cispo":
            is_clipped = (ratio > cispo_cap).expand_as(mask)  # the weight was capped, whatever the sign of A
        else:
            is_clipped = ((ratio < 1 - eps_low) & (advantages < 0)) | ((ratio > 1 + eps_high) & (advantages > 0))
        count = tokens.clamp(min=1.0)
        clip_fraction = (is_clipped.to(mask.dtype) * mask).sum() / count
        kl_mean = (kl.detach() * mask).sum() / count
    return GRPOLossTerms(loss=loss, kl=kl_mean, clip_fraction=clip_fraction, tokens=tokens.detach())
