"""A config and a cluster in, the plan out: layout, memory per device and whether it fits, step time.

The layout is the trainer's own: `ParallelDims.from_config` resolves `dp_shard = -1` and checks the
degrees against the cluster's device count with the trainer's messages, and `split_global_batch`
splits the global batch into micro-batches the same way. The compute dtype is the one the run would
get on an accelerator: `training.dtype = "auto"` is bfloat16 on every chip the planner knows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from titan_tpu import models
from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.config.batch import split_global_batch
from titan_tpu.device.dtype import dtype_from_name
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.plan.activations import ActivationEstimate, Geometry, estimate_activations, lm_head_bytes
from titan_tpu.plan.census import Census, census
from titan_tpu.plan.chips import Cluster
from titan_tpu.plan.context_parallel import with_gathered_kv, with_mask
from titan_tpu.plan.memory import Fit, MemoryEstimate, Precision, check_fit, estimate_memory
from titan_tpu.plan.roofline import COMPUTE_EFFICIENCY, StepEstimate, StepShape, estimate_step
from titan_tpu.plan.workload import Workload, workload


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    micro_batch: int
    grad_accum: int
    precision: Precision


@dataclass(frozen=True)
class MemoryPlan:
    layout: Layout
    census: Census
    workload: Workload
    activations: ActivationEstimate
    memory: MemoryEstimate


@dataclass(frozen=True)
class Plan:
    config: TrainConfig
    cluster: Cluster
    detail: MemoryPlan
    fit: Fit
    step: StepEstimate
    compute_efficiency: float


def precision_of(config: TrainConfig) -> Precision:
    """Element sizes the run computes and reduces in; "auto" plans bfloat16, which every chip in
    `chips.py` computes natively."""
    compute = "float32" if config.training.dtype == "float32" else "bfloat16"
    reduce = compute if compute == "float32" else config.parallelism.fsdp_reduce_dtype
    return Precision(
        dtype_from_name(compute, "training.dtype").itemsize,
        dtype_from_name(reduce, "parallelism.fsdp_reduce_dtype").itemsize,
    )


def layout_of(config: TrainConfig, devices: int) -> Layout:
    dims = ParallelDims.from_config(config.parallelism, devices)
    if dims.pp_enabled:
        # Its memory and step time would be those of the whole model on every rank: wrong, not rough.
        raise ConfigError(
            f"parallelism.pp = {dims.pp}: the planner does not model pipeline stages yet; plan with parallelism.pp = 1"
        )
    micro_batch, grad_accum = split_global_batch(
        config.training.global_batch_size, config.training.local_batch_size, dims.dp
    )
    return Layout(dims, micro_batch, grad_accum, precision_of(config))


CensusOf = Callable[[TrainConfig, ParallelDims], Census]


def plan_memory(config: TrainConfig, devices: int, census_of: CensusOf = census) -> MemoryPlan:
    """Memory of the most loaded of `devices` processes, without a cluster (no HBM, no roofline).
    `census_of` builds the model's census (on meta: a search over layouts passes a cached one)."""
    layout = layout_of(config, devices)
    dims = layout.dims
    model = census_of(config, dims)
    work = workload(config, model.args)
    parallelism = config.parallelism
    # With cp > 1 each device holds tokens_per_sample / cp tokens of every sample (plan/context_parallel.py).
    geometry = Geometry(
        micro_batch=layout.micro_batch,
        tokens_per_sample=work.tokens_per_sample // dims.cp,
        act_bytes=layout.precision.compute_bytes,
        tp=dims.tp,
        sequence_parallel=parallelism.sequence_parallel,
        loss_parallel=parallelism.loss_parallel,
    )
    spec = models.get_model_spec(config.model.name)
    if spec.block_activations is None:
        raise ConfigError(f"model '{config.model.name}' has no activation estimate (ModelSpec.block_activations)")
    if dims.cp_enabled and not spec.context_parallel:
        raise ConfigError(
            f"parallelism.cp = {dims.cp}: model {config.model.name} has no context-parallel attention "
            "(llama3 and qwen3 have); set parallelism.cp = 1"
        )
    args = model.args
    head = lm_head_bytes(args.vocab_size, args.dim, geometry) if work.unit == "tokens" else (0.0, 0.0)
    block = spec.block_activations(args, geometry)
    if dims.cp_enabled:
        block = with_gathered_kv(block, args.n_kv_heads * args.attn_head_dim, geometry, dims.cp)
    activations = estimate_activations(block, model.n_blocks, geometry, config.activation_checkpoint, head)
    if dims.cp_enabled:
        activations = with_mask(activations, work.tokens_per_sample, dims.cp)
    memory = estimate_memory(model, activations, layout.precision, sharded=dims.fsdp_enabled)
    return MemoryPlan(layout, model, work, activations, memory)


def make_plan(
    config: TrainConfig, cluster: Cluster, compute_efficiency: float = COMPUTE_EFFICIENCY, census_of: CensusOf = census
) -> Plan:
    detail = plan_memory(config, cluster.devices, census_of)
    layout, model, work = detail.layout, detail.census, detail.workload
    dims, args = layout.dims, model.args
    if cluster.chip.fast_link == "ICI" and dims.dp_replicate % cluster.slices:
        # The trainer's rule on TPUs (titan_tpu/distributed/topology.py): only dp_replicate crosses DCN.
        raise ConfigError(
            f"parallelism.dp_replicate: {cluster.name} is {cluster.slices} slices and only dp_replicate "
            f"crosses slices (over DCN), so dp_replicate must be a multiple of {cluster.slices}"
        )
    routing = models.get_model_spec(config.model.name).expert_routing
    moe_top_k = routing(args).top_k if routing is not None else 0
    shape = StepShape(
        devices=dims.world_size,
        dp_shard=dims.fsdp_shards,  # FSDP's group: the cp ranks shard too
        dp_replicate=dims.dp_replicate,
        tp=dims.tp,
        ep=dims.ep,
        micro_batch=layout.micro_batch,
        grad_accum=layout.grad_accum,
        tokens_per_sample=work.tokens_per_sample // dims.cp,  # what one device's activations hold
        dim=args.dim,
        vocab=args.vocab_size if work.unit == "tokens" else 0,
        loss_parallel=config.parallelism.loss_parallel,
        moe_top_k=moe_top_k,
        n_blocks=model.n_blocks,
        recomputed_blocks=config.activation_checkpoint.recomputed_blocks(model.n_blocks),
        reshard=config.parallelism.fsdp_reshard_after_forward,
        cp=dims.cp,
        kv_dim=args.n_kv_heads * args.attn_head_dim if dims.cp_enabled else 0,
    )
    items = config.training.global_batch_size * work.items_per_sample
    step = estimate_step(
        model, shape, layout.precision, cluster, work.flops_per_item, work.block_forward_flops_per_item,
        items, compute_efficiency, work.tp_replicated_flops_per_item,
    )  # fmt: skip
    fit = check_fit(detail.memory, cluster.hbm_bytes_per_device)
    return Plan(config, cluster, detail, fit, step, compute_efficiency)
