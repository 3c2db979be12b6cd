"""What TRL's trainers read from Accelerate, for the parity tests that run one of their methods on a
trainer made with `__new__`: one process on the CPU."""

from __future__ import annotations

import torch


class OneProcessAccelerator:
    """One process: reductions and gathers are the identity."""

    num_processes = 1
    process_index = 0
    device = torch.device("cpu")

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather
