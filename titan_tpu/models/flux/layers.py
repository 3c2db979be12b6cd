"""The pieces a FLUX.1 block is made of: sinusoidal + MLP embedders, adaptive-LayerNorm modulation,
3-axis rotary position embedding, QK-normalised attention heads and the GELU MLP.

Rotary layout: adjacent elements (2i, 2i+1) of a head form one rotated pair (the layout FLUX.1 was
trained with and diffusers uses); Llama's half-split layout would give different outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from titan_tpu.models.common.norms import RMSNorm
from titan_tpu.models.common.rope import rope_inv_freq

# FLUX.1 normalises with eps 1e-6 everywhere (the QK RMSNorms and the affine-free LayerNorms).
NORM_EPS = 1e-6


def init_linear(layer: nn.Linear) -> None:
    """N(0, 0.02^2) weights and zero bias: the init of every Linear that is not zero-initialised."""
    nn.init.normal_(layer.weight, std=0.02)
    nn.init.zeros_(layer.bias)


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """t [B] (already scaled to 0..1000) -> [B, dim] as [cos, sin] of geometric frequencies, in float32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class MLPEmbedder(nn.Module):
    """in_layer -> SiLU -> out_layer: maps a timestep / guidance feature or the pooled text vector to dim."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.in_layer = nn.Linear(in_dim, dim)
        self.out_layer = nn.Linear(dim, dim)

    def init_weights(self) -> None:
        init_linear(self.in_layer)
        init_linear(self.out_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class Modulation(nn.Module):
    """silu(vec) -> `chunks` vectors of width dim (shift / scale / gate), each [B, 1, dim].

    Zero-initialised (adaLN-Zero): every block starts as the identity and the model's output as zero,
    which keeps the start of training stable; the gradient still reaches these weights.
    """

    def __init__(self, dim: int, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks
        self.lin = nn.Linear(dim, chunks * dim)

    def init_weights(self) -> None:
        nn.init.zeros_(self.lin.weight)
        nn.init.zeros_(self.lin.bias)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.chunks, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """LayerNorm without learned affine, then the per-sample affine from the conditioning."""
    return F.layer_norm(x, (x.shape[-1],), eps=NORM_EPS) * (1 + scale) + shift


def rope_tables(ids: torch.Tensor, axes_dim: tuple[int, ...], theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [L, n_axes] positions -> (cos, sin) [L, sum(axes_dim) // 2] in float32.

    Axis a rotates its axes_dim[a] // 2 pairs by ids[:, a] * theta^(-2i / axes_dim[a]); the tables of the
    axes are concatenated, so a head's first pairs encode the text index, the next ones the row, then the
    column. Angles are computed in float32 (TPUs have no float64); positions here are small.
    """
    angles = []
    for axis, width in enumerate(axes_dim):
        inv_freq = rope_inv_freq(width, theta, scaling=None, device=ids.device)
        angles.append(ids[:, axis].float()[:, None] * inv_freq[None, :])
    joined = torch.cat(angles, dim=-1)
    return joined.cos(), joined.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D] with pairs (2i, 2i+1) rotated by the angle of pair i; cos/sin [L, D // 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class HeadProjections(nn.Module):
    """q, k, v projections of one stream with per-head QK RMSNorm; returns [B, H, L, head_dim] each."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        # RMSNorm over the head width, statistics in float32.
        self.q_norm = RMSNorm(head_dim, NORM_EPS)
        self.k_norm = RMSNorm(head_dim, NORM_EPS)

    def init_weights(self) -> None:
        for layer in (self.wq, self.wk, self.wv):
            init_linear(layer)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The head count comes from the weights, so a tensor-parallel shard runs the same code.
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        return self.q_norm(q), self.k_norm(k), v


def joint_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Bidirectional attention over the joint (text + image) sequence; [B, H, L, D] -> [B, L, H * D]."""
    out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
    return out.transpose(1, 2).flatten(2)


class GeluMLP(nn.Module):
    """w1 -> GELU (tanh approximation, as FLUX.1 was trained) -> w2."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.w2 = nn.Linear(hidden_dim, dim)

    def init_weights(self) -> None:
        init_linear(self.w1)
        init_linear(self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))
