"""Euler sampling of the learned flow, from noise (t = 1) to data (t = 0), with classifier-free
guidance, and a PNG grid of the results."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from titan_tpu.tasks.rectified_flow.flow import shift_time

# (x_t [B, L, C], t [B], conditioned?) -> velocity [B, L, C]
VelocityFn = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


@torch.no_grad()
def euler_sample(
    velocity: VelocityFn, noise: torch.Tensor, steps: int, cfg_scale: float, time_shift: float = 1.0
) -> torch.Tensor:
    """Integrate dx/dt = v from t = 1 to 0 in `steps` Euler steps on the (shifted) time grid the model
    was trained on. cfg_scale w: v = v_uncond + w (v_cond - v_uncond); 1 runs the conditioned model only."""
    times = shift_time(torch.linspace(1.0, 0.0, steps + 1), time_shift).tolist()
    x = noise
    for t_now, t_next in zip(times[:-1], times[1:]):
        t = torch.full((x.shape[0],), t_now, device=x.device)
        v = velocity(x, t, True)
        if cfg_scale != 1.0:
            unconditioned = velocity(x, t, False)
            v = unconditioned + cfg_scale * (v - unconditioned)
        x = x + (t_next - t_now) * v.float()
    return x


def save_grid(images: torch.Tensor, rows: int, path: Path, min_side: int = 64) -> Path:
    """images [N, 3, S, S] in [-1, 1], N = rows * columns, row-major -> one PNG. Small images are
    enlarged (nearest neighbour) so that each tile is at least `min_side` pixels."""
    n, _, side, _ = images.shape
    columns = n // rows
    zoom = max(1, -(-min_side // side))
    pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    pixels = pixels.repeat_interleave(zoom, dim=2).repeat_interleave(zoom, dim=3)
    tile, pad = side * zoom, 2
    grid = np.full((rows * (tile + pad) + pad, columns * (tile + pad) + pad, 3), 255, dtype=np.uint8)
    for i in range(rows * columns):
        r, c = divmod(i, columns)
        top, left = pad + r * (tile + pad), pad + c * (tile + pad)
        grid[top : top + tile, left : left + tile] = pixels[i].permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid, "RGB").save(path, format="PNG")
    return path
