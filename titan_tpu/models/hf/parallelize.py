"""Tensor parallelism for the hf family from the model's own plan: transformers merges the config's
`base_model_tp_plan` (decoder layers, embedding) with the causal-LM class's `_tp_plan` (the head)
into `model.tp_plan`, module paths with `*` for the layer index and a style name per path. Each
style name is translated here into a `torch.distributed.tensor.parallel` style, so the model is
sharded as DTensors on the tp mesh like our own families and composes with FSDP, activation
checkpointing and compile in the run's fixed order (titan_tpu/distributed/parallelize.py).

transformers' attention reshapes with `-1` heads and keeps the query/key-value group ratio, so its
code runs unchanged on a rank's heads. Every parameter the plan leaves alone (norms, routers,
experts, biases of replicated layers) becomes a replicated DTensor on the tp mesh, because FSDP,
gradient clipping and the optimizer's foreach kernels need every parameter on one mesh; it is read
as a plain local tensor while the decoder layer holding it runs (`LocalReplicate`), so whatever
transformers' code does with it runs.

Expert parallelism comes from the expert plan (`model.ep_plan`): the experts modules it dispatches
to hold num_experts / ep experts each (`ExpertDispatch`), laid out and FSDP-sharded by the native
families' rule (titan_tpu/distributed/expert_parallel.py).
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from titan_tpu.config.errors import ConfigError
from titan_tpu.distributed.expert_parallel import (
    GatherRows,
    ScaleGrad,
    ScatterRows,
    num_experts,
    shard_experts,
    validate_expert_parallel,
)
from titan_tpu.distributed.parallel_dims import ParallelContext
from titan_tpu.distributed.tensor_parallel import install_logits_layout
from titan_tpu.models.hf.model import HFCausalLM, is_experts_module

if TYPE_CHECKING:  # transformers is imported where a model is built
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


# (module, parameter name, gradient placements): a DTensor parameter that code reads as a plain tensor.
LocalParameter = tuple[nn.Module, str, "list[Placement] | None"]


def compute_on_local_tensors(unit: nn.Module, parameters: list[LocalParameter]) -> None:
    """While `unit` runs forward, the DTensor `parameters` (of it or of modules inside it) are their
    local tensors: transformers' code indexes and slices them, and reads a child's weight from its
    parent's forward, as plain tensors. The backward of `to_local` hands each gradient back as a
    DTensor with the entry's placements (None: the parameter's own); a Partial one is summed over
    the mesh when it meets the parameter."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def to_local(mod: nn.Module, args: Any) -> None:
        # Read the parameters here, not at install time: FSDP swaps its gathered ones in before forward.
        for owner, name, placements in parameters:
            param = owner._parameters.get(name)
            if isinstance(param, DTensor):
                swapped.append((owner, name, param))
                owner._parameters[name] = param.to_local(grad_placements=placements)

    def restore(mod: nn.Module, args: Any, output: Any) -> None:
        for owner, name, param in swapped:
            owner._parameters[name] = param
        swapped.clear()

    unit.register_forward_pre_hook(to_local)
    unit.register_forward_hook(restore)


def own_parameters(module: nn.Module, placements: list[Placement] | None = None) -> list[LocalParameter]:
    return [(module, name, placements) for name, _ in module.named_parameters(recurse=False)]


class LocalReplicate(ParallelStyle):
    """The module's own parameters replicated over the tp mesh (as DTensors), read as their local
    tensors by whatever code runs in the decoder layer (or the rest of the model) that holds them
    (`compute_on_local_tensors`, installed by `apply_hf_tp`), with plain inputs that every tp rank
    holds whole.

    `partial_grads`: the module sees only this rank's share of the activations (a per-head norm
    between a column-split and a row-split layer, transformers' "replicated_with_grad_allreduce"),
    so each rank's parameter gradient is a part of the whole and they are summed over the group.
    """

    def __init__(self, partial_grads: bool = False) -> None:
        super().__init__()
        self.partial_grads = partial_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        # Which layer reads them is decided once the whole model is sharded (apply_hf_tp).
        module.__dict__["local_parameters"] = own_parameters(
            module, [Partial()] if self.partial_grads else [Replicate()]
        )
        return module


class LocalParams(ParallelStyle):
    """The module's own parameters, split by their plan entries, used as their local shards."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        compute_on_local_tensors(module, own_parameters(module))
        return module


class LatentKeyValueProjection(LocalReplicate):
    """Multi-head latent attention's joint projection (transformers' "mla_kv_a_proj"): replicated,
    its output [..., latent + rope] split in two. The latent part reaches the heads through a
    column-split layer, which sums its input gradient over the group; the rope part (the key's
    shared rotary slice) goes to this rank's heads directly, so its gradient is summed here."""

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)

        def sum_rope_grads(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            latent, rope = output.split([output.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            # Seen as replicated, handed back with a Partial gradient: backward sums it over the group.
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([latent, rope.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(sum_rope_grads)
        return module


def _styles(loss_parallel: bool, config: Any = None) -> dict[str, Callable[[], ParallelStyle]]:
    """transformers' style names -> ours. A column-split layer's output stays split (the next
    row-split layer reduces it) unless the name says gather; the head's logits stay vocab-sharded
    under loss parallelism."""
    gathered_logits = Shard(-1) if loss_parallel else Replicate()
    return {
        "colwise": lambda: ColwiseParallel(),
        # transformers' "unit" splits give every rank at least one head where the heads are fewer
        # than the ranks; where tp divides the heads (which check_plan requires) they are the plain ones.
        "unit_colwise": lambda: ColwiseParallel(),
        "unit_rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": lambda: RowwiseParallel(),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        # Vocabulary-split embedding: each rank looks up its rows, the partial sums are reduced.
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        # Width-split embedding: each rank looks up a slice of every vector, the slices are gathered.
        "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "replicated_with_grad_allreduce": lambda: LocalReplicate(partial_grads=True),
        "replicate": lambda: LocalReplicate(),
        "mla_kv_a_proj": lambda: LatentKeyValueProjection(config.qk_rope_head_dim),
        # A module whose own parameter the plan splits (attention sinks, one per head: "colwise" on
        # the parameter) computes on its shard.
        "local_params": lambda: LocalParams(),
        "head": lambda: ColwiseParallel(output_layouts=gathered_logits, use_local_output=not loss_parallel),
    }


# The plan's styles that split a layer, and the dimension of its weight they split (nn.Linear's
# weight is [out, in]; nn.Embedding's [vocab, dim]).
SPLIT_DIM = {
    "colwise": 0,
    "unit_colwise": 0,
    "colwise_gather_output": 0,
    "colwise_rep": 0,
    "embedding_rowwise": 0,
    "rowwise": 1,
    "unit_rowwise": 1,
    "rowwise_split_input": 1,
    "rowwise_rep": 1,
    "embedding_colwise": 1,
}


def expand_patterns(hf: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """A transformers plan with every `*` matched against `hf`'s module and parameter paths: path ->
    style name."""
    paths = [*dict(hf.named_modules()), *dict(hf.named_parameters())]
    expanded: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + r"\Z")
        expanded.update(dict.fromkeys((path for path in paths if regex.match(path)), style))
    return expanded


def expand_plan(hf: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """The TP plan expanded (`expand_patterns`). A parameter may be named only as a column split
    whose module computes on local parameters ("local_params"); any other is refused."""
    expanded = expand_patterns(hf, plan)
    parameters = dict(hf.named_parameters())
    for path, style in expanded.items():
        owner = path.rpartition(".")[0]
        if path in parameters and not (style == "colwise" and expanded.get(owner) == "local_params"):
            raise ConfigError(
                f"parallelism.tp: {type(hf).__name__}'s TP plan splits the parameter {path!r} ({style}), "
                "which model 'hf' does not translate; set parallelism.tp = 1"
            )
    return expanded


def check_plan(hf: PreTrainedModel, plan: Mapping[str, str], tp: int) -> None:
    """Every style is one we translate, and every size the plan splits divides by tp (the heads
    through their projections' widths)."""
    architecture = type(hf).__name__
    known = _styles(loss_parallel=False)
    for path, style in plan.items():
        if style not in known:
            raise ConfigError(
                f"parallelism.tp = {tp}: {architecture}'s TP plan gives {path} the style {style!r}, which "
                f"model 'hf' does not translate (it does: {', '.join(sorted(known))}); set parallelism.tp = 1"
            )
    config = hf.config.get_text_config()
    if any(style in ("colwise", "unit_colwise") for style in plan.values()):
        # Attention split by heads (colwise q/k/v): each rank takes whole query and key-value heads.
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, field, None)
            if isinstance(heads, int) and heads % tp != 0:
                raise ConfigError(
                    f"parallelism.tp = {tp} does not divide {architecture}'s {field} ({heads}), which its TP "
                    "plan splits; pick a tp that does"
                )
    parameters = dict(hf.named_parameters())
    if "mla_kv_a_proj" in plan.values() and not isinstance(getattr(config, "qk_rope_head_dim", None), int):
        raise ConfigError(f"parallelism.tp = {tp}: {architecture}'s config has no qk_rope_head_dim for mla_kv_a_proj")
    for path, style in plan.items():
        if path in parameters:
            size = parameters[path].shape[0]
            if size % tp != 0:
                raise ConfigError(
                    f"parallelism.tp = {tp} does not divide the {size} rows of {path} ({architecture}'s TP plan: "
                    f"{style}); pick a tp that does"
                )
        elif style in SPLIT_DIM:
            weight = hf.get_submodule(path).weight
            if not isinstance(weight, torch.Tensor):
                raise ConfigError(f"parallelism.tp = {tp}: {path} ({architecture}'s TP plan: {style}) has no weight")
            size = weight.shape[SPLIT_DIM[style]]
            if size % tp != 0:
                raise ConfigError(
                    f"parallelism.tp = {tp} does not divide the width {size} of {path} ({architecture}'s TP "
                    f"plan: {style}); pick a tp that does"
                )


def tp_plan_for(model: HFCausalLM, tp: int) -> dict[str, str]:
    """The checked plan of `model` (an HFCausalLM) for `tp` ranks: module path in `model.hf` ->
    transformers' style name. Refused in one line: no plan for the decoder layers, a style we do
    not translate, a size it splits that tp does not divide, a tied head split unlike its embedding."""
    hf = model.hf
    architecture = type(hf).__name__
    expanded = expand_plan(hf, hf.tp_plan)
    if not any(path.startswith(model.layers_path + ".") for path in expanded):
        raise ConfigError(
            f"parallelism.tp = {tp}: {architecture} has no tensor-parallel plan for its decoder layers in "
            "transformers (its config's base_model_tp_plan); set parallelism.tp = 1"
        )
    check_plan(hf, expanded, tp)
    head, embedding = module_path(hf, hf.get_output_embeddings()), module_path(hf, hf.get_input_embeddings())
    embedding_style = expanded.get(embedding) if embedding is not None else None
    if model.args.tie_embeddings and head in expanded and embedding_style != "embedding_rowwise":
        # The head splits the vocabulary; a tied embedding must be split the same way (one tensor).
        raise ConfigError(
            f"parallelism.tp = {tp}: {architecture}'s TP plan splits its tied head ({head}: {expanded[head]}) but "
            f"its embedding as {embedding_style or 'replicated'}; set parallelism.tp = 1"
        )
    return expanded


def module_path(root: nn.Module, module: nn.Module | None) -> str | None:
    return next((path for path, candidate in root.named_modules() if candidate is module), None)


def bare_parameter_split(param: torch.Tensor) -> Shard:
    """A bare parameter the plan splits is split by rows (one per head), like the projections'
    output columns."""
    return Shard(max(param.ndim - 2, 0))


def module_styles(model: HFCausalLM, expanded: Mapping[str, str], loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Our style for each module path (in `model.hf`) of a checked plan; the head's keeps its logits
    vocab-sharded under loss parallelism."""
    hf = model.hf
    head = module_path(hf, hf.get_output_embeddings())
    styles = _styles(loss_parallel, hf.config.get_text_config())
    parameters = dict(hf.named_parameters())
    chosen: dict[str, ParallelStyle] = {}
    for path, style in expanded.items():
        if path not in parameters:
            name = "head" if path == head and style in ("colwise", "colwise_gather_output", "colwise_rep") else style
            chosen[path] = styles[name]()
    return chosen


class HFTensorParallelPlan:
    """`apply_hf_tp`'s plan as data, for the planner (ModelSpec.planning.tp_plan): the style of each module
    path of an HFCausalLM and the Shard of each bare parameter it splits. Sequence parallelism is
    not applied to this family."""

    def styles(self, model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        model = _hf_causal_lm(model)
        expanded = tp_plan_for(model, tp)
        parameters = dict(model.hf.named_parameters())
        chosen: dict[str, Any] = {
            f"hf.{path}": style for path, style in module_styles(model, expanded, loss_parallel).items()
        }
        for path in (path for path in expanded if path in parameters):
            chosen[f"hf.{path}"] = bare_parameter_split(parameters[path])
        return chosen


HF_TP_PLAN = HFTensorParallelPlan()


def _hf_causal_lm(model: nn.Module) -> HFCausalLM:
    """`model` as the HFCausalLM the planner's hooks (typed for any family's model) are handed."""
    if not isinstance(model, HFCausalLM):
        raise TypeError(f"model 'hf''s plans apply to an HFCausalLM, not {type(model).__name__}")
    return model


def apply_hf_tp(model: HFCausalLM, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Shard `model` (an HFCausalLM on meta) over `tp_mesh` by its transformers plan; every
    parameter the plan does not touch is replicated (`LocalReplicate`)."""
    hf = model.hf
    expanded = tp_plan_for(model, tp_mesh.size())
    parameters = dict(hf.named_parameters())
    for path in (path for path in expanded if path in parameters):
        owner, _, name = path.rpartition(".")
        module, param = hf.get_submodule(owner), parameters[path]
        split = distribute_tensor(param, tp_mesh, [bare_parameter_split(param)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
    for path, style in module_styles(model, expanded, loss_parallel).items():
        parallelize_module(hf.get_submodule(path), tp_mesh, style)
    for module in hf.modules():
        own = [p for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]
        if own:
            parallelize_module(module, tp_mesh, LocalReplicate())
    if model.args.tie_embeddings:
        # Each style made its own parameter; the tied head is the embedding's one tensor again.
        hf.get_output_embeddings().weight = hf.get_input_embeddings().weight
    read_replicated_as_local(model)
    install_logits_layout(model, tp_mesh, loss_parallel)


def read_replicated_as_local(model: HFCausalLM) -> None:
    """The replicated parameters (`LocalReplicate`) are read as local tensors while the decoder
    layer holding them runs (the rest while the whole model runs): a parent's forward that reads a
    child's weight, or calls a child's method without its hooks, sees plain tensors too. Each
    layer's FSDP gathers its parameters before this layer-level swap, which runs inside the layer."""
    layers = list(model.block_containers()[0])
    inside_layers = {id(module) for layer in layers for module in layer.modules()}
    for unit, modules in [
        *((layer, list(layer.modules())) for layer in layers),
        (model.hf, [m for m in model.hf.modules() if id(m) not in inside_layers]),
    ]:
        parameters = [entry for module in modules for entry in module.__dict__.get("local_parameters", ())]
        if parameters:
            compute_on_local_tensors(unit, parameters)


# transformers' expert-plan styles: the experts module whose tokens are dispatched, and its [E, ...]
# weights split over ep by expert.
DISPATCH, EXPERT_WEIGHTS = "ep_dispatch_experts", "grouped_gemm"
EXPERT_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


class ExpertDispatch:
    """The tokens of an ep group to every ep rank and the results back, around one transformers
    experts module `(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]`
    holding this rank's num_experts / ep experts.

    Each rank gathers the group's tokens with their routing, runs its own experts on them (the
    others' expert ids become `num_experts`, which transformers' experts skip), and the partial
    outputs are summed and scattered back to the tokens' ranks (all-gather / reduce-scatter: every
    token reaches every expert rank, which is simple and exact; an all-to-all would move only the
    routed tokens). Gradients: an expert's weight gradient collects all ep ranks' tokens, a sum of
    per-rank mean-loss gradients that FSDP then averages only over the expert-FSDP mesh, so the
    experts' output gradient is scaled by 1/ep and their inputs' by ep, as the native experts'
    (titan_tpu/distributed/expert_parallel.py)."""

    def __init__(self, ep_mesh: DeviceMesh, num_experts: int) -> None:
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.local_experts = num_experts // self.ep
        self.first_expert = ep_mesh.get_local_rank() * self.local_experts

    def dispatch(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        hidden, index, weights = (bound.arguments[name] for name in EXPERT_INPUTS)
        hidden = ScaleGrad.apply(GatherRows.apply(hidden, self.group), float(self.ep))
        weights = ScaleGrad.apply(GatherRows.apply(weights, self.group), float(self.ep))
        local = GatherRows.apply(index, self.group) - self.first_expert
        off_rank = (local < 0) | (local >= self.local_experts)
        local = local.masked_fill(off_rank, self.local_experts)
        # transformers' batched and grouped experts implementations read off-rank slots' weights as
        # zero (its own EP zeroes them at dispatch too); their gradient is the owning rank's.
        weights = weights.masked_fill(off_rank, 0.0)
        return (hidden, local, weights), {}

    def combine(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        output = ScaleGrad.apply(output, 1.0 / self.ep)
        return ScatterRows.apply(output, self.group)


def expert_modules(model: nn.Module, ep: int) -> list[nn.Module]:
    """The experts modules transformers' expert plan (`model.hf.ep_plan`) dispatches to, checked:
    each takes EXPERT_INPUTS, its weights are the plan's per-expert ones, and ep divides its experts."""
    hf = _hf_causal_lm(model).hf
    architecture = type(hf).__name__
    expanded = expand_patterns(hf, hf.ep_plan)
    experts = [hf.get_submodule(path) for path, style in expanded.items() if style == DISPATCH]
    if not experts:
        raise ConfigError(
            f"parallelism.ep = {ep}: {architecture} has no expert-parallel plan in transformers "
            "(its config's base_model_ep_plan); set parallelism.ep = 1"
        )
    for path, style in expanded.items():
        if style not in (DISPATCH, EXPERT_WEIGHTS):
            raise ConfigError(
                f"parallelism.ep = {ep}: {architecture}'s expert plan gives {path} the style {style!r}, which model "
                f"'hf' does not translate (it does: {DISPATCH}, {EXPERT_WEIGHTS}); set parallelism.ep = 1"
            )
    for module in experts:
        names = set(inspect.signature(module.forward).parameters)
        weights = {name for name, _ in module.named_parameters(recurse=False)}
        planned = {
            path.rpartition(".")[2]
            for path, style in expanded.items()
            if style == EXPERT_WEIGHTS and hf.get_submodule(path.rpartition(".")[0]) is module
        }
        if not set(EXPERT_INPUTS) <= names or planned != weights or not is_experts_module(module):
            raise ConfigError(
                f"parallelism.ep = {ep}: {architecture}'s experts ({type(module).__name__}) are not the "
                f"{'/'.join(EXPERT_INPUTS)} kind with all weights split by expert; set parallelism.ep = 1"
            )
    return experts


def apply_hf_ep(model: HFCausalLM, ctx: ParallelContext) -> None:
    """Split every experts module of `model` (on meta) over the ep mesh and FSDP them over the
    expert-FSDP mesh (titan_tpu/distributed/expert_parallel.py's layout rule). Under tp as well the
    tp ranks hold the same tokens (no sequence split), so each runs the same experts on them: the
    experts are replicated over tp and `apply_hf_tp`, which runs after, leaves them alone."""
    dims = ctx.dims
    experts = expert_modules(model, dims.ep)
    validate_expert_parallel(dims, num_experts(experts[0]))
    for module in experts:
        hooks = ExpertDispatch(ctx.ep_mesh, num_experts(module))
        for name, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(param, ctx.ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        # Plain attributes of transformers' experts module, which nn.Module's stub types as tensors or modules.
        module.num_experts = hooks.local_experts  # type: ignore[assignment]  # an int attribute
        # Tells transformers' experts implementations that ids == num_experts are other ranks' experts.
        module._is_expert_parallel = True  # type: ignore[assignment]  # a bool attribute
        module.register_forward_pre_hook(hooks.dispatch, with_kwargs=True)
        module.register_forward_hook(hooks.combine)
        compute_on_local_tensors(module, own_parameters(module))
    shard_experts(experts, ctx)


def zero_dtensor_row(weight: torch.Tensor, index: int) -> None:
    """Zero row `index` of `weight` in place, also when it is a DTensor split along dim 0 (where
    `weight[index]` is a copy): a mask every shard multiplies in locally."""
    if not isinstance(weight, DTensor):
        weight[index].zero_()
        return
    keep = torch.ones(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
    keep[index] = 0
    mesh = weight.device_mesh
    weight.mul_(distribute_tensor(keep, mesh, [Replicate()] * mesh.ndim, src_data_rank=None))


def parallelize_hf(model: HFCausalLM, ctx: ParallelContext) -> nn.Module:
    """The hf family's `ModelSpec.parallelize`: tensor parallelism from the model's own plan, expert
    parallelism from its expert plan; under any layout (FSDP's shards too) the padding rows that
    transformers' init zeroes are zeroed on DTensors."""
    model.zero_row = zero_dtensor_row
    if ctx.dims.ep_enabled:
        apply_hf_ep(model, ctx)
    if ctx.dims.tp_enabled:
        if ctx.sequence_parallel:
            logger.info(
                "model hf: tensor parallelism without sequence parallelism (transformers' plans split no sequence)"
            )
        apply_hf_tp(model, ctx.tp_mesh, ctx.loss_parallel_enabled)
    return model
