"""TOML file + command-line overrides -> one typed, validated `TrainConfig`.

The TOML is parsed as data (tomllib), never evaluated. Every key is checked against the section's
dataclass: unknown names get a did-you-mean, values are checked against the field's type and
`Literal` choices, then each section validates its own ranges.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CompileConfig,
    DataConfig,
    DeviceConfig,
    JobConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"


@dataclasses.dataclass
class TrainConfig:
    """The whole run: one attribute per TOML section."""

    job: JobConfig = dataclasses.field(default_factory=JobConfig)
    device: DeviceConfig = dataclasses.field(default_factory=DeviceConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = dataclasses.field(default_factory=LRSchedulerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointConfig = dataclasses.field(
        default_factory=ActivationCheckpointConfig
    )
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)

    def validate(self) -> None:
        for section in self.sections().values():
            section.validate()

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def section_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _did_you_mean(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check a TOML value (or convert a command-line string) to the field's type."""
    from_cli = isinstance(value, str) and tp is not str and typing.get_origin(tp) is not Literal
    if from_cli:
        value = _parse_cli_scalar(value, tp, where)
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}: got {value!r}, expected {_describe(tp)}")
        return value
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str))
    )
    if not ok:
        raise ConfigError(f"{where}: got {value!r}, expected {_describe(tp)}")
    return float(value) if tp is float else value


def _parse_cli_scalar(text: str, tp: Any, where: str) -> Any:
    try:
        if tp is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}: got {text!r}, expected {_describe(tp)}") from None
    return text


def resolve_config_path(name: str) -> Path:
    """`--config NAME` is a path, or a file in train_configs/ with or without `.toml`."""
    candidates = [Path(name), Path(name + ".toml"), CONFIG_DIR / name, CONFIG_DIR / f"{name}.toml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    available = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    hint = _did_you_mean(name, available)
    raise ConfigError(
        f"--config {name}: no such file or config in {CONFIG_DIR}; {hint}"
        f"available: {', '.join(available)}"
    )


def apply_section_values(config: TrainConfig, values: dict[str, Any], source: str) -> None:
    """Set `{section: {key: value}}` on the config, checking every name and type."""
    sections = section_types()
    for section_name, section_values in values.items():
        if section_name not in sections:
            hint = _did_you_mean(section_name, list(sections))
            raise ConfigError(
                f"{source}: unknown section [{section_name}]; {hint}valid: {', '.join(sections)}"
            )
        if not isinstance(section_values, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
        section = getattr(config, section_name)
        types = field_types(type(section))
        for key, value in section_values.items():
            where = f"{source}: {section_name}.{key}"
            if key not in types:
                hint = _did_you_mean(key, list(types))
                raise ConfigError(
                    f"{where}: unknown key in [{section_name}]; {hint}"
                    f"valid keys: {', '.join(types)}"
                )
            setattr(section, key, coerce(value, types[key], where))


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--section.key=value` or `--section.key value`; a bare boolean flag means true."""
    sections = section_types()
    overrides: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"{arg}: unrecognised argument; expected --section.key=value (see --help)"
            )
        name, has_value, value = arg[2:].partition("=")
        section_name, _, key = name.partition(".")
        section_cls = sections.get(section_name)
        is_bool = section_cls is not None and field_types(section_cls).get(key) is bool
        if not has_value:
            next_is_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            if next_is_value:
                value = args[i + 1]
                i += 1
            elif is_bool:
                value = "true"
            else:
                raise ConfigError(f"--{name}: missing value (use --{name}=VALUE)")
        overrides.setdefault(section_name, {})[key] = value
        i += 1
    return overrides


def load_config(config_name: str | None, overrides: list[str]) -> TrainConfig:
    config = TrainConfig()
    if config_name is not None:
        path = resolve_config_path(config_name)
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        apply_section_values(config, values, str(path))
    apply_section_values(config, parse_overrides(overrides), "command line")
    config.validate()
    return config
