"""Every model family and training task a config may name, and the config sections they own.

This is the one line a new family or task adds: its name, where its implementation is (a
"module:attribute" path, imported only when a run asks for it) and the sections it owns (a
"module:Class" path to a dataclass in its own folder). The loader reads the owned sections with the
core ones, so every key is known, typed, checked and listed by `--help` before any task or model is
imported; a section's module imports nothing but the configuration (no torch), and importing it runs
no family or task code (their package doors are empty).

Code outside the package (a user's task, a test) adds an entry at run time through
`titan_tpu.tasks.registry.register_task` or `titan_tpu.models.registry.register_model`, with the
objects themselves instead of paths.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Entry:
    """A family (target: its ModelSpec) or a task (target: its TrainingTask class), and the sections
    it owns (name -> the section's dataclass)."""

    target: str | Any  # "module:attribute", or the object when registered at run time
    sections: Mapping[str, str | type] = field(default_factory=dict)


FAMILIES: dict[str, Entry] = {
    "flux": Entry("titan_tpu.models.flux.spec:FLUX_SPEC"),
    "hf": Entry("titan_tpu.models.hf.spec:HF_SPEC", {"hf": "titan_tpu.models.hf.config:HFConfig"}),
    "llama3": Entry("titan_tpu.models.llama3.spec:LLAMA3_SPEC"),
    "qwen3": Entry("titan_tpu.models.qwen3.spec:QWEN3_SPEC"),
    "qwen3_moe": Entry("titan_tpu.models.qwen3.spec:QWEN3_MOE_SPEC"),
}

TASKS: dict[str, Entry] = {
    "language_model": Entry("titan_tpu.tasks.language_model:LanguageModelTask"),
    "rectified_flow": Entry(
        "titan_tpu.tasks.rectified_flow.task:RectifiedFlowTask",
        {"flux": "titan_tpu.tasks.rectified_flow.config:FluxConfig"},
    ),
    "grpo": Entry("titan_tpu.tasks.grpo.task:GRPOTask", {"rl": "titan_tpu.tasks.grpo.config:RLConfig"}),
    "sft": Entry("titan_tpu.tasks.sft.task:SftTask", {"sft": "titan_tpu.tasks.sft.config:SftConfig"}),
    "dpo": Entry("titan_tpu.tasks.dpo.task:DpoTask", {"dpo": "titan_tpu.tasks.dpo.config:DpoConfig"}),
}


def resolve(target: str | Any) -> Any:
    """The object a "module:attribute" path names (imported now), or `target` itself."""
    if not isinstance(target, str):
        return target
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def add(table: dict[str, Entry], kind: str, name: str, entry: Entry, core_sections: Iterable[str]) -> None:
    """Add a family or task registered at run time. A name registered twice is an error unless it is
    the same object with the same sections (a re-import); a section belongs to one owner and may not
    take the name of a core section."""
    existing = table.get(name)
    if existing is not None:
        same_sections = {k: resolve(v) for k, v in existing.sections.items()} == dict(entry.sections)
        if resolve(existing.target) != entry.target or not same_sections:
            raise ValueError(f"{kind} '{name}' is already registered")
        return
    owners = section_owners()
    for section in entry.sections:
        if section in core_sections:
            raise ValueError(f"{kind} '{name}': [{section}] is a core section")
        if section in owners:
            raise ValueError(f"{kind} '{name}': section [{section}] is taken by {owners[section]}")
    table[name] = entry


def section_owners() -> dict[str, str]:
    """Owned section name -> its owner, e.g. {"rl": "task grpo"}."""
    return {
        section: f"{kind} {name}"
        for kind, table in (("model", FAMILIES), ("task", TASKS))
        for name, entry in table.items()
        for section in entry.sections
    }


def owned_section_types() -> dict[str, type]:
    """Owned section name -> its dataclass, imported now (torch-free modules)."""
    return {
        section: resolve(cls)
        for table in (FAMILIES, TASKS)
        for entry in table.values()
        for section, cls in entry.sections.items()
    }
