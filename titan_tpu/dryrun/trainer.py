"""The trainer's own set-up for one simulated rank of a world that is not here.

`DryRunTrainer` is the `Trainer` (titan_tpu/training/trainer.py) with four of its steps changed, and
every other step, in the same order, its own: the mesh, the task, the model on `meta`, the fixed
parallelisation order (TP/SP, activation checkpointing, FSDP, offload), the pipeline stages, the
optimizer and the checkpoint state.

- device and process group: torch's fake process group ("fake" backend) stands in for the world, at
  this simulated rank; the model is materialised on `meta`, so no weight takes memory; meshes are
  laid out row-major (the TPU's topology-aware rank placement needs the chips: not simulated);
  `training.dtype = "auto"` is bfloat16, as on every accelerator the configs target (the planner's
  rule), whatever this host computes natively.
- kernels: each "auto" kernel takes its fallback; there is no device to measure on.
- metrics: no sinks, nothing written.
- checkpointing: the manager is built without a folder and nothing is loaded: the dry run reads its
  state dicts (what a save would write), it never saves.

Compile is turned off before the set-up (titan_tpu/dryrun/run.py), and the report says so: the fake
step runs eagerly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from titan_tpu.config import ResolvedConfig, TrainConfig
from titan_tpu.device import Device, dtype_name
from titan_tpu.device.dtype import dtype_from_name
from titan_tpu.distributed.process_group import ProcessInfo
from titan_tpu.training.registered_names import RegisteredNames
from titan_tpu.training.seeding import seed_everything
from titan_tpu.training.trainer import Trainer


def simulated_dtype(requested: str) -> torch.dtype:
    """ "auto" is bfloat16 on every accelerator a config targets; a named dtype is itself."""
    return torch.bfloat16 if requested == "auto" else dtype_from_name(requested, "training.dtype")


class DryRunTrainer(Trainer):
    measure_kernels = False

    def __init__(self, config: TrainConfig, names: RegisteredNames, rank: int, world: int) -> None:
        super().__init__(config, names, ProcessInfo(rank=rank, local_rank=0, world_size=world))

    def _setup_device(self) -> None:
        config = self.config
        # The meshes are built for "cpu", where the fake backend is registered; nothing runs there.
        self.device = Device("cpu", 0)
        self.model_device = torch.device("meta")
        if not dist.is_initialized():
            dist.init_process_group("fake", rank=self.process.rank, world_size=self.process.world_size)
        self.is_writer = False  # nothing of the run is written: no resolved config, no metrics
        self.dump_folder = Path(config.job.dump_folder)
        self.compute_dtype = simulated_dtype(config.training.dtype)
        dtype, registered = dtype_name(self.compute_dtype), self.registered
        self.resolved = ResolvedConfig(config, dtype, registered.model_overrides, registered.task)
        seed_everything(config.training.seed, config.training.deterministic)

    def _setup_metrics(self) -> None:
        """No sinks: a dry run writes nothing of the run."""

    def _setup_checkpointing(self) -> None:
        # Built as the trainer builds it, without a folder, so reading its state dicts writes nothing.
        self.checkpointer = self._checkpoint_manager(
            dataclasses.replace(self.config.checkpoint, enable=False, create_seed_checkpoint=False)
        )
