"""Typed configuration: TOML sections as dataclasses, command-line overrides, validation."""

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.loader import TrainConfig, load_config
from titan_tpu.config.render import help_text, to_toml

__all__ = ["ConfigError", "TrainConfig", "help_text", "load_config", "to_toml"]
