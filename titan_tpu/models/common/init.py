"""Weight-initialisation helpers shared by the model families."""

import torch
from torch import nn


def trunc_normal_std_(weight: torch.Tensor, std: float) -> None:
    """Fill `weight` from N(0, std^2) truncated at +-3 std.

    The cut-off is relative to std: `nn.init.trunc_normal_`'s default bounds are absolute (+-2), which
    for std 0.02 would truncate nothing, so an outlier draw could still be 100 std wide.
    """
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3.0 * std, b=3.0 * std)
