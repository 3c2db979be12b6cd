"""Config -> text: the resolved TOML written beside every run, and the `--help` listing."""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_tpu.config import catalogue
from titan_tpu.config.loader import TrainConfig, field_types, section_types
from titan_tpu.config.values import to_toml_value, type_name


def to_toml(config: TrainConfig) -> str:
    lines: list[str] = []
    for name, section in config.sections().items():
        lines.append(f"[{name}]")
        for f in dataclasses.fields(section):
            lines.append(f"{f.name} = {to_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def help_text() -> str:
    lines = [
        "usage: train.py [--import MODULE ...] [--config NAME_OR_PATH] [--print-config] [--section.key=VALUE ...]",
        "",
        "--import MODULE imports a module of yours first (from the current folder or the Python path), so",
        "the task or model family it registers, and its sections, can be used and are listed below.",
        "NAME is a file in titan_tpu/train_configs/ (with or without .toml) or a path to a TOML file.",
        "Every key below can be set in the TOML's [section] or overridden as --section.key=VALUE;",
        "a table entry as --section.key.entry=VALUE (e.g. --model.overrides.n_layers=2).",
        "Lists are written [1, 2] or 1,2; an optional value is unset with none.",
        "",
    ]
    owners = catalogue.section_owners()
    for name, section_cls in section_types().items():
        lines.append(f"[{name}]" + (f"  (the section of {owners[name]})" if name in owners else ""))
        types = field_types(section_cls)
        for f in dataclasses.fields(section_cls):
            default = to_toml_value(_default(f))
            lines.append(f"  {f.name} ({type_name(types[f.name])}, default {default})")
            lines.append(f"      {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines)
