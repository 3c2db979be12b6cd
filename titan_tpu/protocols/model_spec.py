"""A model family as the engine sees it: `ModelSpec`, what it can do (`Capabilities`) and what the
planner asks of it (`PlannerHooks`).

A family's `spec.py` builds one and the registry (titan_tpu/models/registry.py) finds it by name;
the trainer, the tasks, the planner and the checkpoint layer read only what is here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from titan_tpu.config.errors import ConfigError
from titan_tpu.config.values import check, did_you_mean, is_supported, to_toml_value
from titan_tpu.protocols.planning import ActivationGeometry, BlockActivations, ExpertRouting, TensorParallelPlan
from titan_tpu.protocols.state_dict_adapter import StateDictAdapter
from titan_tpu.protocols.tunable import Tunable

# Model arguments that every run sets from its own config, so an override would be overwritten.
RUN_SET_ARGS = {
    "max_seq_len": "training.seq_len",
    "attention": "model.attention_block",
    "expert_impl": "model.moe_impl",
}

# (model output, labels [B, S], chunk_elements) -> the scalar mean loss, ignoring labels == -100;
# chunk_elements is the cross-entropy's chunk (the args' `loss_chunk_elements`, measured).
LossFn = Callable[[Any, torch.Tensor, int], torch.Tensor]


class DecodeStep(Protocol):
    """One decode step through a model's weights outside its modules' forwards (a fused step):
    tokens [B, 1] at `start_pos` in `cache` -> logits [B, 1, V] (or [B, V])."""

    def step(self, tokens: torch.Tensor, cache: Any, start_pos: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Decoding:
    """How a family's model decodes token by token, which the builtin sampler
    (titan_tpu/generation/sampler.py) runs: `new_cache(max_len)` makes an empty cache that the model's
    forward fills (`model(tokens, cache=..., start_pos=..., key_padding_mask=...)`), and
    `fused_step(model)` gives a faster decode step for it, or None to decode through the forward.
    `unsupported(args)`: why a model of these arguments cannot decode this way (None: it can), for a
    family whose models differ (the hf family: a class with state-space layers has no KV cache)."""

    new_cache: Callable[[int], Any]
    fused_step: Callable[[nn.Module], DecodeStep | None]
    unsupported: Callable[[Any], str | None] = lambda args: None


@dataclass(frozen=True)
class Capabilities:
    """What a family's model can take part in; a run that needs what it lacks is refused in one line."""

    # `parallelize` makes the model context-parallel when parallelism.cp > 1 (splits its attention
    # over the cp ranks' tokens: titan_tpu/distributed/context_parallel.py).
    context_parallel: bool = False
    # The model can be cut into pipeline stages (parallelism.pp > 1): it has
    # `keep_pipeline_stage(layers, first, last)` and its forward runs what a stage keeps
    # (titan_tpu/models/common/decoder.py; titan_tpu/distributed/pipeline.py).
    pipeline_stages: bool = False
    # Packed documents are kept apart (`model(tokens, document_ids=...)`, data.document_mask).
    separates_documents: bool = False
    # How it decodes with a KV cache (GRPO's rollouts, SFT's generated answers); None: it does not.
    decoding: Decoding | None = None
    # Its forward may run several times before one backward (GRPO's training forward in length runs,
    # titan_tpu/tasks/grpo/length_runs.py): nothing but autograd carries a forward to its backward.
    # A mixture of experts whose backward reads its last forward's router counts may not.
    repeated_forward: bool = False


@dataclass(frozen=True)
class PlannerHooks:
    """What the planner (`python -m titan_tpu.plan`, planning.py) reads of a family, so that it plans
    a family it does not know.

    tp_plan: the TP plan `parallelize` applies, as data (None: no tensor parallelism).
    block_activations(args, geometry): the bytes per token one block keeps for backward.
    expert_routing(args): for a mixture of experts, its top-k and the FLOPs every tp rank repeats
    (None: dense). expert_modules(model, ep): the experts modules (weights [E, ...]) of a model built
    on meta that ep splits, checked as `parallelize` checks them (None: the native MoE layers'
    `experts`).
    """

    tp_plan: TensorParallelPlan | None = None
    block_activations: Callable[[Any, ActivationGeometry], BlockActivations] | None = None
    expert_routing: Callable[[Any], ExpertRouting] | None = None
    expert_modules: Callable[[nn.Module, int], list[nn.Module]] | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family.

    model_cls(args) builds the model; call it under `torch.device("meta")`, then parallelise, then
    `to_empty(device=...)` and `init_weights()`.
    flops_per_token(args, seq_len) returns TRAINING (forward + backward) FLOPs per token.
    loss_fn: the language-model loss of the model's output (None: the family's task computes its own).
    parallelize(model, ctx) applies the family's tensor / expert parallelism (its parallelize.py);
    state_dict_adapter maps its weights and config to Hugging Face's.
    default_task names the training task that `training.task = "auto"` picks for this family.
    tunables: the model-args fields whose "auto" is measured at start-up (tunable.py).
    args_from_config: for a family whose arguments come from more of the config than [model]'s flavor
    and overrides (the hf family reads its own [hf] section): the loaded config -> its arguments.
    override_value(args, key): the value an override set in the arguments, as the family checked it.
    """

    name: str
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    flops_per_token: Callable[[Any, int], float]
    loss_fn: LossFn | None = None
    parallelize: Callable[..., nn.Module] | None = None
    state_dict_adapter: StateDictAdapter | None = None
    default_task: str = "language_model"
    tunables: tuple[Tunable, ...] = ()
    args_from_config: Callable[[Any], Any] | None = None
    override_value: Callable[[Any, str], Any] = getattr
    capabilities: Capabilities = field(default_factory=Capabilities)
    planning: PlannerHooks = field(default_factory=PlannerHooks)

    def args_for(self, config: Any) -> Any:
        """The arguments a loaded config asks for: [model]'s flavor with its overrides, or what the
        family's `args_from_config` builds from the config."""
        model = config.model
        if self.args_from_config is not None:
            try:
                args = self.args_from_config(config)
            except ValueError as e:  # the family's one-line account of a bad section
                raise ConfigError(str(e)) from None
        else:
            args = self.build_args(model.flavor, model.overrides)
        return self._with_moe_impl(args, model.moe_impl)

    def _with_moe_impl(self, args: Any, moe_impl: str) -> Any:
        """`args` with the expert kernel `model.moe_impl` names; a family without `expert_impl`
        (no experts, or experts it does not choose a kernel for) accepts only "auto"."""
        fields = {f.name for f in dataclasses.fields(args)} if dataclasses.is_dataclass(args) else set()
        if "expert_impl" not in fields:
            if moe_impl != "auto":
                raise ConfigError(
                    f"model.moe_impl = {moe_impl!r}: model {self.name} has no expert kernels to choose; leave it 'auto'"
                )
            return args
        impl = check(moe_impl, typing.get_type_hints(type(args))["expert_impl"], "model.moe_impl")
        return dataclasses.replace(args, expert_impl=impl)

    def flavor(self, name: str) -> Any:
        if name not in self.flavors:
            valid = list(self.flavors)
            raise ConfigError(
                f"unknown flavor '{name}' for model '{self.name}'; {did_you_mean(name, valid)}valid: {', '.join(valid)}"
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
            f.name for f in dataclasses.fields(args) if is_supported(types[f.name]) and f.name not in RUN_SET_ARGS
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
                hint = "" if key in types else did_you_mean(key, settable)
                raise ConfigError(f"{where} {what}; {hint}valid fields: {', '.join(settable)}")
            checked[key] = check(value, types[key], where)
            # Every integer model argument is a size or a count, none of which may be zero.
            if isinstance(checked[key], int) and not isinstance(checked[key], bool) and checked[key] < 1:
                raise ConfigError(f"{where}: must be >= 1, got {checked[key]}")
        try:
            return dataclasses.replace(args, **checked)
        except ValueError as e:
            applied = to_toml_value(checked)
            raise ConfigError(f"model.overrides {applied} on {self.name} {flavor}: {e}") from None
