"""Which nn.Linear modules of a model `lora.target_modules` names (the rule docs/lora.md states).

- "all-linear": every nn.Linear inside the model's repeated blocks (the containers the trainer wraps
  one by one: `titan_tpu.distributed.parallelize.block_containers`), so neither the output head nor
  the embeddings, as PEFT's "all-linear" leaves out the head. A mixture-of-experts router (a linear
  under a module named `router`, Qwen 3 MoE's) is left out too: on transformers' Qwen 3 MoE the router
  is not an nn.Linear and PEFT's "all-linear" does not adapt it, so the adapters stay loadable there.
  Stacked experts are not nn.Linear and are never adapted.
- otherwise each entry is an fnmatch pattern (`*`, `?`, `[...]`, case-sensitive) matched against a
  linear's qualified name in the model (as `model.named_modules()` gives it, before any wrapper), and
  also against its suffixes after a dot, as PEFT matches a plain name: "wq" and "*.wq" both match
  "layers.0.attention.wq"; "layers.0.*" matches the first block's linears. Any nn.Linear of the model
  may be named this way, the head included.

Only plain linears are adapted: a subclass with a forward of its own computes something LoRALinear's
forward would not, and is refused when a pattern names it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from torch import nn

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.sections import ALL_LINEAR


def linear_names(model: nn.Module) -> list[str]:
    """Qualified names of every nn.Linear of `model`, in module order."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]


def matches(name: str, pattern: str) -> bool:
    """Whether `pattern` names the module `name` (fnmatch on the whole name or on a suffix after a dot)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _inside_blocks(model: nn.Module, containers: Iterable[nn.Module]) -> list[str]:
    inside = {id(module) for container in containers for module in container.modules()}
    return [
        name
        for name, module in model.named_modules()
        if id(module) in inside and isinstance(module, nn.Linear) and "router" not in name.split(".")
    ]


def describe_linears(names: list[str]) -> str:
    """The model's linears in a few words: their distinct last components and one full name."""
    if not names:
        return "none"
    last = list(dict.fromkeys(name.rpartition(".")[2] for name in names))
    return f"{', '.join(last)} (e.g. {names[0]})"


def select_targets(model: nn.Module, containers: Iterable[nn.Module], targets: list[str], what: str) -> list[str]:
    """Qualified names of the linears `targets` (lora.target_modules) names in `model`, whose repeated
        blocks are `containers`; ConfigError (one line) when a pattern names none, when the blocks hold no
        linear, when a named linear is a subclass with its own forward, or when its weight is tied to another
    parameter. `what` names the model."""
    if targets == [ALL_LINEAR]:
        chosen = _inside_blocks(model, containers)
        if not chosen:
            raise ConfigError(
                f"lora.enable: {what} has no nn.Linear in its repeated blocks to adapt ('{ALL_LINEAR}'); "
                "LoRA is not available for it, set lora.enable = false"
            )
    else:
        every = linear_names(model)
        chosen = []
        for pattern in targets:
            named = [name for name in every if matches(name, pattern)]
            if not named:
                raise ConfigError(
                    f"lora.target_modules: {pattern!r} matches no nn.Linear of {what}; its linears: "
                    f"{describe_linears(every)}"
                )
            chosen += [name for name in named if name not in chosen]
    modules = dict(model.named_modules())
    # Every name a parameter goes by: a tied weight (a head sharing the embedding table) has two.
    names_of: dict[int, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(param_name)
    for name in chosen:
        tied = [other for other in names_of[id(modules[name].weight)] if other != f"{name}.weight"]
        if tied:
            raise ConfigError(
                f"lora.target_modules: {name}'s weight is tied to {tied[0]}; an adapter on a shared matrix would "
                "change both, and the merged export writes the matrix once: leave it out of the patterns"
            )
        if type(modules[name]).forward is not nn.Linear.forward:
            raise ConfigError(
                f"lora.target_modules: {name} is a {type(modules[name]).__name__} with a forward of its own, which "
                "LoRA's would replace; list patterns that name plain nn.Linear modules only"
            )
    return chosen
