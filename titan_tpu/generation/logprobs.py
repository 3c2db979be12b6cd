"""Log-probabilities of tokens under a model: what the sampler records while it draws, what GRPO's
objective and its reference policy compute in a forward, and what validation's loss is made of."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a decoder's output: the tensor itself, or the `logits` of an output that carries
    more (a mixture of experts' output also carries its routers' aux loss)."""
    return output if isinstance(output, torch.Tensor) else output.logits


def token_logps(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of every next token: [b, L] -> [b, L-1], in float32."""
    return logps_of(model(tokens), tokens)


def logps_of(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    """`token_logps` from the model's output over `tokens` (logits, or an output carrying them)."""
    logits = logits_of(output)[:, :-1].float()
    return logits.gather(-1, tokens[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
