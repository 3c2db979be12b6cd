"""A linear layer with a low-rank adapter (LoRA, Hu et al. 2021), as the `peft` package defines it:

    y = x W^T + b + (dropout(x) A^T B^T) * alpha / rank

with W (and b) frozen, A [rank, in] and B [out, rank] trained, B starting at zero so that the adapted
model begins as the base. It is an `nn.Linear`, so a tensor-parallel plan, FSDP and the models' own
code treat it as the projection it wraps; `weight` and `bias` keep their names, so checkpoints and the
Hugging Face state-dict adapters read the base as before. The adapter is the two extra parameters
`lora_A` and `lora_B` beside them.

Single-device code: the placement of A and B under tensor parallelism is set from outside.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Linear):
    """An `nn.Linear` whose output gains a trained low-rank term; `adapter_enabled = False` turns the
    term off (the base model, e.g. DPO's reference, without a second copy)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {rank}")
        self.rank = rank
        self.alpha = alpha
        # A probability, not a child module: torch's row-wise style shards the weight of every module
        # inside the linear it is given, and a dropout module has none.
        self.dropout = dropout
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.adapter_enabled = True

    @classmethod
    def wrapping(cls, linear: nn.Linear, *, rank: int, alpha: float, dropout: float) -> LoRALinear:
        """A LoRALinear that takes over `linear`'s weight and bias (the same Parameter objects), frozen."""
        adapted = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
        )
        adapted.weight = linear.weight
        adapted.bias = linear.bias
        adapted.weight.requires_grad_(False)
        if adapted.bias is not None:
            adapted.bias.requires_grad_(False)
        adapted.train(linear.training)
        return adapted

    @property
    def scaling(self) -> float:
        """alpha / rank, the factor on the low-rank term."""
        return self.alpha / self.rank

    @torch.no_grad()
    def reset_adapter(self) -> None:
        """PEFT's default initialisation: A as nn.Linear's own (Kaiming uniform, a = sqrt(5)), B = 0."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        if self.dropout > 0:
            x = F.dropout(x, self.dropout, self.training)
        low_rank = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return out + low_rank * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, lora_alpha={self.alpha}"


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(qualified name, layer) of every adapted linear in `model`."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's outputs for the duration: every adapter's term switched off, then back on."""
    layers = [layer for _, layer in lora_layers(model)]
    previous = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer, was in zip(layers, previous):
            layer.adapter_enabled = was
