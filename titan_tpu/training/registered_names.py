"""A loaded config's names checked against the registries: model family, flavor, model overrides and
training task.

`load_config` checks what the config alone can tell and imports no torch; the registries import it.
So every entry point that builds or plans a run (train.py, the planner, the scripts) calls
`check_registered_names` right after loading, and a misspelled name is one line before any work
starts. The trainer takes the model family, the task and the checked overrides from the result. Only
the registries' tables are read and no task is imported, so the planner may use it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_tpu.config import ConfigError, TrainConfig, catalogue
from titan_tpu.models.registry import get_model_spec
from titan_tpu.protocols.model_spec import ModelSpec
from titan_tpu.tasks.registry import require_task, task_names


@dataclass(frozen=True)
class RegisteredNames:
    """What a config's names stand for."""

    spec: ModelSpec
    task: str  # the training task, "auto" replaced by the family's own
    # model.overrides as the flavor's dataclass checked them: an integer given for a float argument is
    # the float the model gets.
    model_overrides: dict[str, Any]


def check_registered_names(config: TrainConfig) -> RegisteredNames:
    model = config.model
    try:
        spec = get_model_spec(model.name)
    except ConfigError as e:
        raise ConfigError(f"model.name: {e}") from None
    try:
        spec.flavor(model.flavor)
    except ConfigError as e:
        raise ConfigError(f"model.flavor: {e}") from None
    args = spec.args_for(config)
    overrides = {key: spec.override_value(args, key) for key in model.overrides}

    task = config.training.task
    if task != "auto":
        require_task(task)
    elif spec.default_task not in task_names():
        raise ConfigError(
            f"training.task: 'auto' means model {spec.name}'s task '{spec.default_task}', which is not "
            f"in titan_tpu/tasks/registry.py; valid: {', '.join(task_names())}"
        )
    else:
        task = spec.default_task
    check_task_sections(config, task)
    return RegisteredNames(spec, task, overrides)


def check_task_sections(config: TrainConfig, task: str) -> None:
    """The sections tasks own, against the task that runs: another task's section set to anything but
    its defaults would be ignored, so it is refused; the running task's section checks the values of
    other sections it reads (`check_with(config)`: a data path its dataset would not read, a held-out
    source it cannot use), now that the task is known ('auto' resolved)."""
    if config.data.chat_template and task in ("language_model", "rectified_flow"):
        raise ConfigError(
            f"data.chat_template: renders the chat records of the sft and grpo tasks; training.task '{task}' "
            "reads no chat; remove it"
        )
    owners = catalogue.section_owners()
    for name, section in config.owned.items():
        owner = owners.get(name, "")
        if not owner.startswith("task "):
            continue
        owner_task = owner.removeprefix("task ")
        if owner_task != task:
            if section != type(section)():
                raise ConfigError(
                    f"[{name}] applies to training.task = '{owner_task}', not '{task}'; remove its keys or "
                    f"set training.task = '{owner_task}'"
                )
            continue
        check_with = getattr(section, "check_with", None)
        if check_with is not None:
            check_with(config)
