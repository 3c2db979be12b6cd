"""Training tasks: what differs between kinds of training (see base.py); the trainer runs any of them."""

from titan_tpu.tasks.base import TaskContext, TaskLoss, TrainingTask
from titan_tpu.tasks.registry import task_class, task_names

__all__ = ["TaskContext", "TaskLoss", "TrainingTask", "task_class", "task_names"]
