"""How `training.global_batch_size` splits over the data-parallel ranks and into micro-batches: the
one config check that needs the data-parallel degree, so it runs where the mesh is known (the trainer,
the planner)."""

from __future__ import annotations

from titan_tpu.config.errors import ConfigError


def split_global_batch(global_batch: int, local_batch: int, dp_degree: int) -> tuple[int, int]:
    """(samples per forward pass, micro-batches per step); local -1 means no accumulation."""
    if local_batch == -1:
        if global_batch % dp_degree != 0:
            raise ConfigError(
                f"training.global_batch_size {global_batch} is not divisible by the data-parallel degree {dp_degree}"
            )
        return global_batch // dp_degree, 1
    per_step = local_batch * dp_degree
    if global_batch % per_step != 0:
        raise ConfigError(
            f"training.global_batch_size {global_batch} is not divisible by local_batch_size "
            f"{local_batch} x data-parallel degree {dp_degree} = {per_step}"
        )
    return local_batch, global_batch // per_step
