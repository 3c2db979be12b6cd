"""Task name -> the TrainingTask class that implements it, imported only when a run asks for it.

Adding a kind of training is one line here (and, when it has settings of its own, a section in
titan_tpu/config/task_sections.py); `[training] task = "auto"` takes the model family's own task
(`ModelSpec.default_task`). The module imports no task, so entry points check a config's task name
against it (titan_tpu/registered_names.py) without loading one.
"""

from __future__ import annotations

import importlib

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.values import did_you_mean

# name -> "module:Class"; imported lazily so a language-model run never imports image or RL code.
TASKS: dict[str, str] = {
    "language_model": "titan_tpu.tasks.language_model:LanguageModelTask",
    "rectified_flow": "titan_tpu.tasks.rectified_flow.task:RectifiedFlowTask",
    "grpo": "titan_tpu.tasks.grpo.task:GRPOTask",
    "sft": "titan_tpu.tasks.sft.task:SftTask",
}


def task_names() -> list[str]:
    return sorted(TASKS)


def require_task(name: str) -> None:
    """A ConfigError naming training.task unless `name` is a registered task."""
    if name not in TASKS:
        raise ConfigError(
            f"training.task: unknown task '{name}'; {did_you_mean(name, task_names())}"
            f"valid: auto, {', '.join(task_names())}"
        )


def task_class(name: str) -> type:
    require_task(name)
    module_name, _, class_name = TASKS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
