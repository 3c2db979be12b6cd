"""Name -> ModelSpec registry: how the trainer finds a model family, its sizes and its helpers."""

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.common.loss import cross_entropy_loss


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
    """

    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    flops_per_token: Callable[[Any, int], float]
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] = cross_entropy_loss
    parallelize: Callable[..., nn.Module] | None = None
    state_dict_adapter: Any | None = None

    def flavor(self, name: str) -> Any:
        if name not in self.flavors:
            valid = list(self.flavors)
            raise ValueError(
                f"unknown flavor '{name}' for model '{self.name}'; valid: {', '.join(valid)}"
                f"{_did_you_mean(name, valid)}"
            )
        return self.flavors[name]


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
        raise ValueError(f"unknown model '{name}'; valid: {', '.join(valid)}{_did_you_mean(name, valid)}")
    return _REGISTRY[name]
