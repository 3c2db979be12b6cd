"""Task name -> the TrainingTask class that implements it, imported only when a run asks for it.

The shipped tasks are listed, with the config sections they own, in titan_tpu/config/catalogue.py
(the one line a new task adds); `[training] task = "auto"` takes the model family's own task
(`ModelSpec.default_task`). A task written elsewhere (a test, a user's package) registers itself with
`register_task`. The module imports no task, so entry points check a config's task name against it
(titan_tpu/training/registered_names.py) without loading one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from titan_tpu.config import catalogue
from titan_tpu.config.errors import ConfigError
from titan_tpu.config.loader import core_section_names
from titan_tpu.config.values import did_you_mean

if TYPE_CHECKING:
    from titan_tpu.tasks.base import TrainingTask


def register_task(name: str, task: type[TrainingTask], sections: Mapping[str, type] | None = None) -> None:
    """Add a task and the config sections it owns (section name -> its dataclass, each field made with
    `titan_tpu.config.sections.opt`); configs loaded afterwards read, check and list them."""
    catalogue.add(catalogue.TASKS, "task", name, catalogue.Entry(task, dict(sections or {})), core_section_names())


def task_names() -> list[str]:
    return sorted(catalogue.TASKS)


def require_task(name: str) -> None:
    """A ConfigError naming training.task unless `name` is a registered task."""
    if name not in catalogue.TASKS:
        raise ConfigError(
            f"training.task: unknown task '{name}'; {did_you_mean(name, task_names())}"
            f"valid: auto, {', '.join(task_names())}"
        )


def task_class(name: str) -> type[TrainingTask]:
    require_task(name)
    task: type[TrainingTask] = catalogue.resolve(catalogue.TASKS[name].target)
    return task
