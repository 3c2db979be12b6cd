"""Small set-up steps of a run that need no model or mesh: seeding, the resolved config on disk, and
how the global batch splits into per-rank micro-batches."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from titan_tpu.config import ConfigError


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless elsewhere.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def write_resolved_config(dump_folder: Path, text: str) -> None:
    """Write dump_folder/config.toml; a different one left by an earlier run in the same folder is
    kept as config.N.toml rather than overwritten."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    path = dump_folder / "config.toml"
    if path.exists() and path.read_text(encoding="utf-8") != text:
        previous = 1
        while (dump_folder / f"config.{previous}.toml").exists():
            previous += 1
        path.rename(dump_folder / f"config.{previous}.toml")
    path.write_text(text, encoding="utf-8")


def split_global_batch(global_batch: int, local_batch: int, dp_degree: int) -> tuple[int, int]:
    """(samples per forward pass, micro-batches per step); local -1 means no accumulation."""
    if local_batch == -1:
        if global_batch % dp_degree != 0:
            raise ConfigError(
                f"training.global_batch_size {global_batch} is not divisible by the data-parallel "
                f"degree {dp_degree}"
            )
        return global_batch // dp_degree, 1
    per_step = local_batch * dp_degree
    if global_batch % per_step != 0:
        raise ConfigError(
            f"training.global_batch_size {global_batch} is not divisible by local_batch_size "
            f"{local_batch} x data-parallel degree {dp_degree} = {per_step}"
        )
    return local_batch, global_batch // per_step
