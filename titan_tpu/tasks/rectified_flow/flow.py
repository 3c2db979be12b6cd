"""Rectified flow on packed latents: 2x2 packing into tokens, position ids, the time schedule and
the interpolation x_t = (1 - t) x0 + t noise whose velocity noise - x0 the model learns."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), C*4]: each token is a 2x2 patch, channel-major (diffusers' order)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of `pack` for latents of `height` x `width`."""
    b, _, packed = tokens.shape
    c = packed // 4
    patches = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, height, width)


def image_ids(height: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """[(H/2)(W/2), 3] ids (0, row, column) of the packed tokens of a height x width latent."""
    rows, cols = torch.meshgrid(
        torch.arange(height // 2, device=device), torch.arange(width // 2, device=device), indexing="ij"
    )
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def text_ids(length: int, device: torch.device | None = None) -> torch.Tensor:
    """FLUX.1 gives text tokens position zero on every axis: T5 already encodes their order."""
    return torch.zeros(length, 3, device=device)


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """s t / (1 + (s - 1) t): s > 1 moves mass towards t = 1 (more noise), as high resolutions need."""
    return shift * t / (1 + (shift - 1) * t)


def sample_time(
    batch: int, kind: str, mean: float, std: float, shift: float, generator: torch.Generator
) -> torch.Tensor:
    """Flow times in (0, 1): logit-normal sigmoid(N(mean, std)) or uniform, then shifted."""
    if kind == "logit_normal":
        t = torch.sigmoid(torch.randn(batch, generator=generator) * std + mean)
    else:
        t = torch.rand(batch, generator=generator)
    return shift_time(t, shift)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, target velocity) with x_t = (1 - t) x0 + t noise, target = d x_t / dt = noise - x0."""
    t = t.view(-1, *([1] * (x0.dim() - 1)))
    return (1 - t) * x0 + t * noise, noise - x0
