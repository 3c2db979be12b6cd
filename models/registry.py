"""Name -> ModelSpec registry: how the trainer finds a model family, its sizes and its helpers."""

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.common.loss import cross_entropy_loss
from titan_tpu.config.errors import ConfigError
from titan_tpu.config.values import check, is_supported, to_toml_value

# Model arguments that every run sets from its own config, so an override would be overwritten.
RUN_SET_ARGS = {"max_seq_len": "training.seq_len", "attention": "model.attention_block"}


def _did_you_mean(name: str, valid: list[str]) -> str:
    """'; did you mean 'x'?' for the closest valid name, or '' when nothing is close."""
    by_case = [v for v in valid if v.lower() == name.lower()]
    close = by_case or difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family.

    model_cls(args) builds the model; call it under `torch.device("meta")`, then parallelise, then
    `to_empty(device=...)` and `init_weights()`.
    flops_per_token(args, seq_len) returns TRAINING (forward + backward) FLOPs per token.
    loss_fn(model_output, labels[B, S]) returns the scalar mean loss, ignoring labels == -100.
    parallelize and state_dict_adapter are filled in by the parallelism and checkpoint layers.
    default_task names the training task (titan_tpu/tasks/registry.py) that `training.task = "auto"`
    picks for this family.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    flops_per_token: Callable[[Any, int], float]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = cross_entropy_loss
    parallelize: Callable[..., nn.Module] | None = None
    state_dict_adapter: Any | None = None
    default_task: str = "language_model"

    def flavor(self, name: str) -> Any:
        if name not in self.flavors:
            valid = list(self.flavors)
            raise ConfigError(
                f"unknown flavor '{name}' for model '{self.name}'; valid: {', '.join(valid)}"
                f"{_did_you_mean(name, valid)}"
            )
        return self.flavors[name]

    def build_args(self, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
        """The flavor's arguments with `overrides` (model.overrides) applied.

        Each name must be a field of the flavor's dataclass and each value of that field's type;
        the dataclass's own checks (heads dividing dim, ...) then run on the result. Every failure is
        a ConfigError naming model.overrides.
        """
        args = self.flavor(flavor)
        if not overrides:
            return args
        types = typing.get_type_hints(type(args))
        settable = [
            f.name
            for f in dataclasses.fields(args)
            if is_supported(types[f.name]) and f.name not in RUN_SET_ARGS
        ]
        checked: dict[str, Any] = {}
        for key, value in overrides.items():
            where = f"model.overrides.{key}"
            if key in RUN_SET_ARGS:
                raise ConfigError(f"{where}: set from {RUN_SET_ARGS[key]} on every run; set that instead")
            if key not in settable:
                what = (
                    "is a nested structure that cannot be overridden"
                    if key in types
                    else f"is not a field of {type(args).__name__}"
                )
                hint = "" if key in types else _did_you_mean(key, settable)
                raise ConfigError(f"{where} {what}; valid fields: {', '.join(settable)}{hint}")
            checked[key] = check(value, types[key], where)
            # Every integer model argument is a size or a count, none of which may be zero.
            if isinstance(checked[key], int) and not isinstance(checked[key], bool) and checked[key] < 1:
                raise ConfigError(f"{where}: must be >= 1, got {checked[key]}")
        try:
            return dataclasses.replace(args, **checked)
        except ValueError as e:
            applied = to_toml_value(checked)
            raise ConfigError(f"model.overrides {applied} on {self.name} {flavor}: {e}") from None


# The registry is the one piece of module state: families add themselves when `models` is imported.
_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Add a family. Registering a name twice is an error unless it is an equal spec (a re-import)."""
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"model '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        valid = model_names()
        raise ConfigError(f"unknown model '{name}'; valid: {', '.join(valid)}{_did_you_mean(name, valid)}")
    return _REGISTRY[name]
