"""TOML file + command-line overrides -> one typed, validated `TrainConfig`.

The TOML is parsed as data (tomllib), never evaluated. Every key is checked against the section's
dataclass: unknown names get a did-you-mean, values are checked against the field's type (see
values.py), then each section validates its own ranges. Besides the core sections, every model
family and training task may own sections (catalogue.py): their dataclasses live in their owners'
folders and are read here, torch-free, like the core ones. The names that live in registries (model,
flavor, model overrides, training task) are checked by the entry points right after loading
(titan_tpu/training/registered_names.py), and the returned config is never changed afterwards (what a
run resolves from it goes into titan_tpu/config/resolved.py's record).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, TypeVar

from titan_tpu.config import catalogue
from titan_tpu.config.context_parallel import check_context_parallel
from titan_tpu.config.errors import ConfigError
from titan_tpu.config.pipeline_parallel import check_pipeline_parallel
from titan_tpu.config.sections import (
    ActivationCheckpointConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    DataConfig,
    DeviceConfig,
    JobConfig,
    LoRAConfig,
    LRSchedulerConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    ProfilingConfig,
    TrainingConfig,
    ValidationConfig,
)
from titan_tpu.config.values import (
    check,
    did_you_mean,
    from_text,
    is_table,
    optional_inner,
    parse_toml_literal,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

# The shipped configs, titan_tpu/train_configs/ (installed with the package as its data).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"


Section = TypeVar("Section")

# Keys that moved to a section of their own: a config that still sets one is told where it went.
MOVED_KEYS = {
    "model.hf_config": "hf.config",
    "model.hf_architecture": "hf.architecture",
    "model.trust_remote_code": "hf.trust_remote_code",
}


def _owned_sections() -> dict[str, Any]:
    return {name: cls() for name, cls in catalogue.owned_section_types().items()}


@dataclasses.dataclass
class TrainConfig:
    """The whole run: one attribute per core TOML section; the sections a family or a task owns are
    in `owned`, read with `section(TheirClass)`."""

    job: JobConfig = dataclasses.field(default_factory=JobConfig)
    device: DeviceConfig = dataclasses.field(default_factory=DeviceConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = dataclasses.field(default_factory=LRSchedulerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallelism: ParallelismConfig = dataclasses.field(default_factory=ParallelismConfig)
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    activation_checkpoint: ActivationCheckpointConfig = dataclasses.field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = dataclasses.field(default_factory=ProfilingConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    owned: dict[str, Any] = dataclasses.field(default_factory=_owned_sections)

    def __post_init__(self) -> None:
        # The TOML file it was loaded from (None: no file), set by load_config. Not a field, so not a
        # section and not compared: files a config names by module (GRPO's own rewards) are looked
        # for beside it too.
        self.source_file: Path | None = None

    def section(self, cls: type[Section]) -> Section:
        """The owned section of class `cls` (e.g. `config.section(RLConfig)` is [rl])."""
        for section in self.owned.values():
            if type(section) is cls:
                return section
        raise KeyError(f"{cls.__name__} is not a registered section (titan_tpu/config/catalogue.py)")

    def validate(self) -> None:
        owners = catalogue.section_owners()
        for name, section in self.sections().items():
            family = owners.get(name, "").removeprefix("model ")
            if name in self.owned and owners[name].startswith("model ") and family != self.model.name:
                # A family's section applies to its own models only: a value given for another
                # family's would be ignored.
                if section != type(section)():
                    raise ConfigError(
                        f"[{name}] applies to model.name = '{family}', not '{self.model.name}'; "
                        f"remove its keys or set model.name = '{family}'"
                    )
                continue
            section.validate()
        check_context_parallel(self)
        check_pipeline_parallel(self)
        if self.lora.enable and self.checkpoint.create_seed_checkpoint:
            raise ConfigError(
                "checkpoint.create_seed_checkpoint: a LoRA run saves only its adapters, which start alike on "
                "every layout (B = 0, A drawn the same whatever the sharding), and its base comes from "
                "checkpoint.initial_load_path; there is nothing to seed, set it false"
            )
        if self.lora.enable and self.parallelism.pp > 1:
            # Not built: the stages would carry the adapters, but the schedules' split input and weight
            # backward (zero bubble) has not been run with frozen weights.
            raise ConfigError(
                f"lora.enable: LoRA is not supported with parallelism.pp = {self.parallelism.pp} yet; "
                "set parallelism.pp = 1"
            )
        if self.profiling.enable and self.profiling.start_step > self.training.steps:
            raise ConfigError(
                f"profiling.start_step: {self.profiling.start_step} is after the run's last step "
                f"(training.steps = {self.training.steps}); trace a step the run takes"
            )

    def sections(self) -> dict[str, Any]:
        """Section name -> section, the core ones first, then the owned ones."""
        core = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "owned"}
        return {**core, **self.owned}


def core_section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig) if f.name != "owned"]


def section_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    core = {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if f.name != "owned"}
    return {**core, **catalogue.owned_section_types()}


def field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _is_bool(tp: Any) -> bool:
    return tp is bool or optional_inner(tp) is bool


def resolve_config_path(name: str) -> Path:
    """`--config NAME` is a path, or a file in titan_tpu/train_configs/ with or without `.toml`."""
    candidates = [Path(name), Path(name + ".toml"), CONFIG_DIR / name, CONFIG_DIR / f"{name}.toml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    available = sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))
    hint = did_you_mean(name, available)
    raise ConfigError(
        f"--config {name}: no such file or config in {CONFIG_DIR}; {hint}available: {', '.join(available)}"
    )


def _set_table_entry(section: Any, field: str, entry: str, value: Any, from_cli: bool) -> None:
    """`key.entry = value` into a table field: merges one entry instead of replacing the table.
    Entries are checked by the layer that owns them (model overrides: the model registry)."""
    table = dict(getattr(section, field))
    table[entry] = parse_toml_literal(value) if from_cli else value
    setattr(section, field, table)


def apply_section_values(config: TrainConfig, values: dict[str, Any], source: str, from_cli: bool = False) -> None:
    """Set `{section: {key: value}}` on the config, checking every name and type. Command-line
    values are text and are converted to the field's type; TOML values must already have it."""
    sections = section_types()
    for section_name, section_values in values.items():
        if section_name not in sections:
            hint = did_you_mean(section_name, list(sections))
            raise ConfigError(f"{source}: unknown section [{section_name}]; {hint}valid: {', '.join(sections)}")
        if not isinstance(section_values, dict):
            raise ConfigError(f"{source}: [{section_name}] must be a table of keys")
        section = config.sections()[section_name]
        types = field_types(type(section))
        for key, value in section_values.items():
            where = f"{source}: {section_name}.{key}"
            field, dot, entry = key.partition(".")
            moved = MOVED_KEYS.get(f"{section_name}.{field}")
            if moved is not None:
                raise ConfigError(f"{where}: moved to {moved}; set that instead")
            if field not in types:
                hint = did_you_mean(field, list(types))
                raise ConfigError(f"{where}: unknown key in [{section_name}]; {hint}valid keys: {', '.join(types)}")
            if dot and not is_table(types[field]):
                raise ConfigError(f"{where}: {section_name}.{field} is not a table")
            if dot:
                _set_table_entry(section, field, entry, value, from_cli)
            elif from_cli:
                setattr(section, key, from_text(value, types[key], where))
            else:
                setattr(section, key, check(value, types[key], where))


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--section.key=value` or `--section.key value`; a bare boolean flag means true.
    `--section.table.entry=value` sets one entry of a table field (e.g. --model.overrides.n_layers=2)."""
    sections = section_types()
    overrides: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"{arg}: unrecognised argument; expected --section.key=value (see --help)")
        name, has_value, value = arg[2:].partition("=")
        section_name, _, key = name.partition(".")
        section_cls = sections.get(section_name)
        is_bool = section_cls is not None and _is_bool(field_types(section_cls).get(key))
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
        config.source_file = path.resolve()
    apply_section_values(config, parse_overrides(overrides), "command line", from_cli=True)
    config.validate()
    return config
