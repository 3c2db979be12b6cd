"""Joining the job's process group from the environment torchrun (or a GKE launcher) sets."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    local_rank: int
    world_size: int


def process_info() -> ProcessInfo:
    """Rank and world size from torchrun's variables; a plain `python train.py` is rank 0 of 1."""
    return ProcessInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


def init_process_group(backend: str, info: ProcessInfo, timeout_s: float = 600.0) -> None:
    """Join the group when there is more than one process; a single process needs none."""
    if info.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
