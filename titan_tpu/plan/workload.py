"""What one training step computes, as the planner counts it: the run's task says
(`TrainingTask.planned_workload`), from the config and the model's arguments, without building
anything. The task is the one the trainer would run: `training.task`, or the family's
`ModelSpec.default_task` under "auto"."""

from __future__ import annotations

from typing import Any

from titan_tpu.config import TrainConfig
from titan_tpu.models.registry import get_model_spec
from titan_tpu.protocols.planning import Workload
from titan_tpu.tasks.registry import task_class


def workload(config: TrainConfig, args: Any) -> Workload:
    spec = get_model_spec(config.model.name)
    task = spec.default_task if config.training.task == "auto" else config.training.task
    return task_class(task).planned_workload(config, spec, args)
