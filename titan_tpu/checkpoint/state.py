"""The pieces of a training run's state, each as a Stateful object DCP can save and load.

Model and optimizer go through `torch.distributed.checkpoint.state_dict`, so FSDP/TP-sharded
parameters are saved as DTensor shards and resharded on load into whatever layout the loading run has.
Small Python states (schedule, step, data position, RNG) are saved as single items, loaded with
`torch.load(weights_only=True)`. Per-rank states (RNG, data loader) are keyed `rank_<r>`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from titan_tpu.config.errors import ConfigError


class ModelState(Stateful):
    """The model's tensors by name. `trainable_only`: the frozen parameters are left out, saved and
    loaded (a LoRA run's base, which is rebuilt from the initial weights, never changes): what the
    checkpoint holds is then the adapters, under the model's own names (`layers.0.attention.wq.lora_A`)."""

    def __init__(self, model: nn.Module, trainable_only: bool = False) -> None:
        self.model = model
        self.trainable_only = trainable_only

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=StateDictOptions(ignore_frozen_params=self.trainable_only))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Without the frozen parameters the dict is partial by design; `check_model_fits` has compared
        # its names and shapes with the checkpoint's before anything was read.
        options = StateDictOptions(strict=not self.trainable_only, ignore_frozen_params=self.trainable_only)
        set_model_state_dict(self.model, state_dict, options=options)


def check_model_fits(folder: Any, model_shapes: dict[str, tuple[int, ...]], saved_keys: dict[str, Any]) -> None:
    """ConfigError naming the first differences between the model's tensors (name -> full shape, of
    every rank: a pipeline stage holds some of them) and the checkpoint's."""
    here = {f"model.{k}": shape for k, shape in model_shapes.items()}
    saved = {
        k: tuple(md.size)
        for k, md in saved_keys.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    problems = [f"missing {k}" for k in sorted(here.keys() - saved.keys())]
    problems += [f"unexpected {k}" for k in sorted(saved.keys() - here.keys())]
    problems += [
        f"{k} is {list(saved[k])} in the checkpoint but {list(here[k])} in this model"
        for k in sorted(here.keys() & saved.keys())
        if here[k] != saved[k]
    ]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(
            f"checkpoint {folder} does not fit this model: {'; '.join(problems[:3])}{more}; "
            "was it saved with another model.name/flavor?"
        )


# Checkpoints saved before the optimizer state was flattened keep the param groups as a list:
# `optimizer.param_groups.0.lr`, `optimizer.param_groups.0.params`, ...
_POSITIONAL_GROUPS = re.compile(r"optimizer\.param_groups\.\d+\.params(\.\d+)?$")


def has_positional_param_groups(saved_keys: Iterable[str]) -> bool:
    """Whether a checkpoint keeps the optimizer's param groups by position (the older layout)."""
    return any(_POSITIONAL_GROUPS.match(key) for key in saved_keys)


class OptimizerState(Stateful):
    """Keyed by parameter name, not by position, so it survives re-wrapping and resharding: every
    value under its own key, the param groups' settings too (`optimizer.param_groups.<name>.lr`),
    so a pipeline stage loads its parameters' entries and nothing else (a list of groups would be
    matched by position, and a stage's groups hold other parameters than one process's).
    `flat=False` reads the older layout, whose groups are a list (`has_positional_param_groups`)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = StateDictOptions(flatten_optimizer_state_dict=flat)

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)


def _leaf(value: Any) -> tuple[Any]:
    # DCP traverses dicts and lists; a tuple is a leaf, so the whole state is one item in the checkpoint
    # and loading does not depend on its inner structure.
    return (value,)


class ObjectState(Stateful):
    """An object with state_dict()/load_state_dict() (the lr scheduler), saved as one item."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"state": _leaf(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict["state"][0])


class TrainState(Stateful):
    """The number of optimizer steps taken."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": _leaf(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"][0])


class PerRankObjectState(Stateful):
    """An object's state saved under `rank_<r>`; on load, the key given (own rank, or a fallback)."""

    def __init__(self, obj: Any, rank: int) -> None:
        self.obj = obj
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{self.rank}": _leaf(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        (value,) = state_dict.values()
        self.obj.load_state_dict(value[0])


def get_rng_state(device_type: str) -> dict[str, Any]:
    """Python, numpy, torch CPU and (if there is one) accelerator RNG states, as loadable types."""
    np_state = np.random.get_state(legacy=True)  # numpy's default, spelled out: the stub's default is the dict form
    if not isinstance(np_state, tuple):
        raise RuntimeError("numpy's global generator is not the legacy MT19937 one; its state cannot be saved")
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(np_state[0]),
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if device_type != "cpu":
        state["device"] = torch.get_device_module(device_type).get_rng_state()
    return state


def set_rng_state(state: dict[str, Any], device_type: str) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["algorithm"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if device_type != "cpu" and "device" in state:
        torch.get_device_module(device_type).set_rng_state(state["device"])


class RNGState(Stateful):
    """This rank's RNG states under `rank_<r>`."""

    def __init__(self, rank: int, device_type: str) -> None:
        self.rank = rank
        self.device_type = device_type

    def state_dict(self) -> dict[str, Any]:
        return {f"rank_{self.rank}": _leaf(get_rng_state(self.device_type))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        (value,) = state_dict.values()
        set_rng_state(value[0], self.device_type)
