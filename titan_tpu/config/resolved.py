"""What a run decided from its config, kept apart from the config that was loaded.

The loaded `TrainConfig` is never changed after `load_config`: every layer reads the same values the
user wrote. What the run made of them travels here instead: the compute dtype `training.dtype = "auto"`
became on this device, the model overrides as the flavor's dataclass checked them (an integer given
for a float argument is the float the model gets), and the task `training.task = "auto"` named. The
run's `<dump_folder>/config.toml` is written from this record, so it shows what the run used and loads
back with `load_config` into a run that makes the same decisions.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from titan_tpu.config.loader import TrainConfig
from titan_tpu.config.render import to_toml


@dataclass(frozen=True)
class ResolvedConfig:
    config: TrainConfig  # as loaded; read, never written
    compute_dtype: Literal["bfloat16", "float32"]
    model_overrides: dict[str, Any]
    task: str

    def effective(self) -> TrainConfig:
        """A separate config with the resolved values in place of the requested ones."""
        effective = copy.deepcopy(self.config)
        effective.training.dtype = self.compute_dtype
        effective.training.task = self.task
        effective.model.overrides = dict(self.model_overrides)
        return effective

    def to_toml(self) -> str:
        return to_toml(self.effective())


def write_resolved_config(dump_folder: Path, resolved: ResolvedConfig) -> None:
    """Write dump_folder/config.toml; a different one left by an earlier run in the same folder is
    kept as config.N.toml rather than overwritten."""
    text = resolved.to_toml()
    dump_folder.mkdir(parents=True, exist_ok=True)
    path = dump_folder / "config.toml"
    if path.exists() and path.read_text(encoding="utf-8") != text:
        previous = 1
        while (dump_folder / f"config.{previous}.toml").exists():
            previous += 1
        path.rename(dump_folder / f"config.{previous}.toml")
    path.write_text(text, encoding="utf-8")
