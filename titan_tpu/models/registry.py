"""Name -> ModelSpec: how the trainer finds a model family, its sizes and its helpers.

The shipped families are listed by import path and imported when a run asks for one, so a run loads
its own family only (the hf family alone loads transformers) and this table is read without torch.
A family written elsewhere (a test, a user's package) adds itself with `register_model`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.values import did_you_mean

if TYPE_CHECKING:
    from titan_tpu.protocols.model_spec import ModelSpec

# name -> "module:attribute" of the family's ModelSpec: the one line a new family adds.
FAMILIES: dict[str, str] = {
    "flux": "titan_tpu.models.flux.spec:FLUX_SPEC",
    "hf": "titan_tpu.models.hf.spec:HF_SPEC",
    "llama3": "titan_tpu.models.llama3.spec:LLAMA3_SPEC",
    "qwen3": "titan_tpu.models.qwen3.spec:QWEN3_SPEC",
    "qwen3_moe": "titan_tpu.models.qwen3.spec:QWEN3_MOE_SPEC",
}

# Families registered at run time, and the shipped ones once imported.
_REGISTERED: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Add a family. Registering a name twice is an error unless it is an equal spec (a re-import)."""
    existing = _REGISTERED.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"model '{spec.name}' is already registered")
    _REGISTERED[spec.name] = spec


def model_names() -> list[str]:
    return sorted({*FAMILIES, *_REGISTERED})


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTERED:
        if name not in FAMILIES:
            valid = model_names()
            raise ConfigError(f"unknown model '{name}'; {did_you_mean(name, valid)}valid: {', '.join(valid)}")
        module, _, attribute = FAMILIES[name].partition(":")
        register_model(getattr(importlib.import_module(module), attribute))
    return _REGISTERED[name]
