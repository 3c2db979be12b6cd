"""The preference objective of a batch of pairs, from the log-probabilities of each completion under the
policy and under the frozen reference, as TRL's DPOTrainer (`_compute_loss`, trl 1.16) defines it.

With d_c = log pi(chosen) - log ref(chosen), d_r the same for the rejected completion (each a sum
over the completion's tokens) and delta = d_c - d_r, per pair:

- sigmoid (DPO, Rafailov et al. 2023): -log sigmoid(beta delta). With label smoothing eps > 0, the
  conservative form (cDPO): -(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta), as
  TRL's DPOTrainer wrote it before 1.0 and its CPO trainer still does (its 1.16 DPOTrainer reads eps
  for 'robust' only, so there label_smoothing with 'sigmoid' does nothing; here it is never ignored).
- robust (Chowdhury et al. 2024): ((1 - eps)(-log sigmoid(beta delta)) + eps log sigmoid(-beta delta))
  / (1 - 2 eps), an unbiased loss when a share eps of the preferences is flipped.
- ipo (Azar et al. 2023): (a_c - a_r - 1 / (2 beta))^2 where a_c, a_r are d_c, d_r divided by each
  completion's token count (TRL averages per token for IPO, as the paper's results do).
- hinge (SLiC): max(0, 1 - beta delta).

The loss is the mean over the pairs. The rewards TRL logs are beta d_c and beta d_r (for every loss
type), a pair is "accurate" when its chosen reward is strictly above its rejected one (a policy equal to
its reference ties every pair: accuracy 0), and the margin is their difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from titan_tpu.tasks.dpo.config import LossType


@dataclass(frozen=True)
class PreferenceTerms:
    loss: torch.Tensor  # scalar, mean over the pairs
    chosen_rewards: torch.Tensor  # [n], detached
    rejected_rewards: torch.Tensor  # [n], detached

    @property
    def accurate(self) -> torch.Tensor:
        """[n] 1.0 where the chosen completion's reward is strictly the higher."""
        return (self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype)


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    *,
    loss_type: LossType,
    beta: float,
    label_smoothing: float = 0.0,
) -> PreferenceTerms:
    """Every argument but the keywords is [n]: log-probabilities summed over each completion's tokens
    (policy and reference), and each completion's token count (read by IPO only)."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        per_pair = -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
    elif loss_type == "robust":
        per_pair = ((1 - eps) * -F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        averaged = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        per_pair = (averaged - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * delta)
    else:  # the config's Literal allows no other value
        raise ValueError(f"unknown loss type {loss_type!r}")
    return PreferenceTerms(per_pair.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
