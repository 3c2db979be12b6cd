"""SwiGLU feed-forward network."""

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.models.common.init import trunc_normal_std_


def llama_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's hidden size: 2/3 of 4*dim (so SwiGLU's three matrices cost what a 4*dim MLP's two do),
    scaled by `ffn_dim_multiplier`, rounded up to a multiple of `multiple_of` for efficient kernels.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_init_std: float) -> None:
        trunc_normal_std_(self.w1.weight, 0.02)
        trunc_normal_std_(self.w3.weight, 0.02)
        # w2 writes into the residual stream, like attention's wo.
        trunc_normal_std_(self.w2.weight, out_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
