"""Root-mean-square layer norm."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale and no bias.

    The statistics are computed in float32 whatever the input dtype, because the mean of squares of bf16
    activations loses the low bits that decide the scale; the result is cast back before the scale is
    applied, which is also the order Hugging Face uses, so logits match it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
