"""Config -> text: the resolved TOML written beside every run, and the `--help` listing."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from titan_tpu.config.loader import TrainConfig, field_types, section_types


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string literal is a valid TOML basic string


def to_toml(config: TrainConfig) -> str:
    lines: list[str] = []
    for name, section in config.sections().items():
        lines.append(f"[{name}]")
        for f in dataclasses.fields(section):
            lines.append(f"{f.name} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(json.dumps(c) for c in typing.get_args(tp))
    return tp.__name__


def help_text() -> str:
    lines = [
        "usage: train.py [--config NAME_OR_PATH] [--print-config] [--section.key=VALUE ...]",
        "",
        "NAME is a file in train_configs/ (with or without .toml) or a path to a TOML file.",
        "Every key below can be set in the TOML's [section] or overridden as --section.key=VALUE.",
        "",
    ]
    for name, section_cls in section_types().items():
        lines.append(f"[{name}]")
        types = field_types(section_cls)
        for f in dataclasses.fields(section_cls):
            default = _toml_value(f.default)
            lines.append(f"  {f.name} ({_type_name(types[f.name])}, default {default})")
            lines.append(f"      {f.metadata['doc']}")
        lines.append("")
    return "\n".join(lines)
