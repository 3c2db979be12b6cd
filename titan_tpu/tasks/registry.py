"""Task name -> the TrainingTask class that implements it, imported only when a run asks for it.

Adding a kind of training is one line here; `[training] task = "auto"` takes the model family's own
task (`ModelSpec.default_task`).
"""

from __future__ import annotations

import importlib

from titan_tpu.config.errors import ConfigError

# name -> "module:Class"; imported lazily so a language-model run never imports image or RL code.
TASKS: dict[str, str] = {
    "language_model": "titan_tpu.tasks.language_model:LanguageModelTask",
    "rectified_flow": "titan_tpu.tasks.rectified_flow.task:RectifiedFlowTask",
    "grpo": "titan_tpu.recipes.grpo.task:GRPOTask",
}


def task_names() -> list[str]:
    return sorted(TASKS)


def task_class(name: str) -> type:
    if name not in TASKS:
        raise ConfigError(f"training.task: unknown task '{name}'; valid: auto, {', '.join(task_names())}")
    module_name, _, class_name = TASKS[name].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
