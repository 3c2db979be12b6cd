"""Rotary position embedding, in the "half rotation" layout Hugging Face checkpoints use.

Each head vector is split into two halves (x1, x2) and rotated as (x1 cos - x2 sin, x2 cos + x1 sin),
with frequency i shared by element i and element i + head_dim/2. Meta's original Llama code pairs
adjacent elements instead; HF permutes q/k weights on conversion to the half layout, so using the half
layout here lets HF weights load unchanged.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are slowed by `factor`, short ones kept, and the band
    in between interpolated smoothly, so a model trained at `original_max_position` extends its context.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, Llama 3.1-scaled when `scaling` is given."""
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than the original context were never seen whole in training: slow them down.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables [max_seq_len, head_dim] as non-persistent buffers.

    They are derived from the config, so they stay out of checkpoints; after a meta-device build they are
    garbage until `reset_buffers` fills them on the target device.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        cos, sin = self._tables(device=None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        # device=None follows the ambient default device, so a build under `torch.device("meta")`
        # costs nothing.
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=device)
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        # Both halves of a head share the same frequencies, hence the duplication.
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def reset_buffers(self, device: torch.device) -> None:
        self.cos, self.sin = self._tables(device)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's max_seq_len {self.max_seq_len}; "
                f"raise max_seq_len in the model args"
            )
        return self.cos[:seq_len], self.sin[:seq_len]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by cos/sin [S, D], or [B, S, D] when each row has its own positions
    (packed documents).

    Done in float32 and cast back: in bf16 the angle of late positions loses precision fast.
    """
    x32 = x.float()
    per_row = cos.dim() == 3
    cos = (cos[:, :, None, :] if per_row else cos[None, :, None, :]).float()
    sin = (sin[:, :, None, :] if per_row else sin[None, :, None, :]).float()
    return (x32 * cos + _rotate_half(x32) * sin).type_as(x)
