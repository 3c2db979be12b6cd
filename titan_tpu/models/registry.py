"""Name -> ModelSpec: how the trainer finds a model family, its sizes and its helpers.

The shipped families are listed, with the config sections they own, in titan_tpu/config/catalogue.py
(the one line a new family adds) and imported when a run names one, so a run loads its own family only
(the hf family alone loads transformers) and this module is read without torch. A family written
elsewhere (a test, a user's package) adds itself with `register_model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from titan_tpu.config import catalogue
from titan_tpu.config.errors import ConfigError
from titan_tpu.config.loader import core_section_names
from titan_tpu.config.values import did_you_mean

if TYPE_CHECKING:
    from titan_tpu.protocols.model_spec import ModelSpec


def register_model(spec: ModelSpec, sections: Mapping[str, type] | None = None) -> None:
    """Add a family and the config sections it owns. Registering a name twice is an error unless it is
    an equal spec (a re-import)."""
    entry = catalogue.Entry(spec, dict(sections or {}))
    catalogue.add(catalogue.FAMILIES, "model", spec.name, entry, core_section_names())


def model_names() -> list[str]:
    return sorted(catalogue.FAMILIES)


def get_model_spec(name: str) -> ModelSpec:
    if name not in catalogue.FAMILIES:
        valid = model_names()
        raise ConfigError(f"unknown model '{name}'; {did_you_mean(name, valid)}valid: {', '.join(valid)}")
    spec: ModelSpec = catalogue.resolve(catalogue.FAMILIES[name].target)
    return spec
