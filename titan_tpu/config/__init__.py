"""Typed configuration: TOML sections as dataclasses, command-line overrides, validation, and the
record of what a run resolved from them."""

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.loader import TrainConfig, load_config
from titan_tpu.config.render import help_text, to_toml
from titan_tpu.config.resolved import ResolvedConfig, write_resolved_config

__all__ = [
    "ConfigError",
    "ResolvedConfig",
    "TrainConfig",
    "help_text",
    "load_config",
    "to_toml",
    "write_resolved_config",
]
