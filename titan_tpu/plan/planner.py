"""A config and a cluster in, the plan out: layout, memory per device and whether it fits, step time.

The layout is the trainer's own: `ParallelDims.from_config` resolves `dp_shard = -1` and checks the
degrees against the cluster's device count with the trainer's messages, and `split_global_batch`
splits the global batch into micro-batches the same way. The compute dtype is the one the run would
get on an accelerator: `training.dtype = "auto"` is bfloat16 on every chip the planner knows.

Under pipeline parallelism the schedule's micro-batches replace the trainer's split (pipeline.py,
`plan_pipeline`), and the plan is that of the most loaded pp rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.config.batch import split_global_batch
from titan_tpu.config.context_parallel import check_context_parallel
from titan_tpu.config.pipeline_parallel import check_pipeline_parallel
from titan_tpu.config.sections import LoRAConfig
from titan_tpu.device.dtype import dtype_from_name
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.distributed.pipeline_plan import PipelinePlan
from titan_tpu.models.registry import get_model_spec
from titan_tpu.plan.activations import ActivationEstimate, Geometry, estimate_activations, lm_head_bytes
from titan_tpu.plan.census import Census, census
from titan_tpu.plan.chips import Cluster
from titan_tpu.plan.context_parallel import with_gathered_kv, with_mask
from titan_tpu.plan.host_offload import (
    fsdp_offload_bytes,
    host_link_seconds,
    host_optimizer_seconds,
)
from titan_tpu.plan.memory import Fit, MemoryEstimate, Precision, check_fit, estimate_memory
from titan_tpu.plan.pipeline import (
    RankShare,
    most_loaded_candidates,
    offloaded_blocks,
    p2p_bytes,
    pipeline_activations,
    pipeline_buffer_bytes,
    pipeline_of,
    rank_census,
    rank_share,
)
from titan_tpu.plan.pipeline_bubble import step_time_factor
from titan_tpu.plan.roofline import COMPUTE_EFFICIENCY, StepEstimate, StepShape, estimate_step
from titan_tpu.plan.workload import workload
from titan_tpu.protocols.planning import Workload


@dataclass(frozen=True)
class Layout:
    dims: ParallelDims
    micro_batch: int
    grad_accum: int  # micro-batches per step: the trainer's accumulation, or the pipeline schedule's
    precision: Precision
    pipeline: PipelinePlan | None = None


@dataclass(frozen=True)
class MemoryPlan:
    layout: Layout
    census: Census
    workload: Workload
    activations: ActivationEstimate
    memory: MemoryEstimate
    local: Census  # the parameters this device's rank holds: census, or its pipeline stages' share
    pp_rank: int = 0  # the pp rank planned (the most loaded one unless asked)
    offloaded_per_microbatch: int = 0  # activation offload's bytes to host per micro-batch


@dataclass(frozen=True)
class Plan:
    config: TrainConfig
    cluster: Cluster
    detail: MemoryPlan
    fit: Fit
    step: StepEstimate
    compute_efficiency: float
    shape: StepShape  # how the step splits its work per device, as the roofline read it


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
    """The degrees and the trainer's batch split, after the trainer's checks of pp and cp (a loaded
    config passed them already, a search's variant has not)."""
    dims = ParallelDims.from_config(config.parallelism, devices)
    check_pipeline_parallel(config)
    check_context_parallel(config)
    micro_batch, grad_accum = split_global_batch(
        config.training.global_batch_size, config.training.local_batch_size, dims.dp
    )
    return Layout(dims, micro_batch, grad_accum, precision_of(config))


def pipelined(layout: Layout, config: TrainConfig, n_layers: int) -> Layout:
    """`layout` with the pipeline's stages, and its micro-batches in place of the local batch."""
    plan = pipeline_of(config, n_layers, layout.dims.dp)
    return dataclasses.replace(
        layout, micro_batch=layout.micro_batch // plan.microbatches, grad_accum=plan.microbatches, pipeline=plan
    )


CensusOf = Callable[[TrainConfig, ParallelDims], Census]


def plan_memory(
    config: TrainConfig, devices: int, census_of: CensusOf = census, pp_rank: int | None = None
) -> MemoryPlan:
    """Memory of the most loaded of `devices` processes, without a cluster (no HBM, no roofline).
    `census_of` builds the model's census (on meta: a search over layouts passes a cached one);
    `pp_rank` plans that pipeline rank instead of the most loaded."""
    layout = layout_of(config, devices)
    dims = layout.dims
    model = census_of(config, dims)
    spec = get_model_spec(config.model.name)
    if dims.pp_enabled:
        if not spec.capabilities.pipeline_stages:
            raise ConfigError(
                f"parallelism.pp = {dims.pp}: model {config.model.name} cannot be cut into pipeline stages "
                "(llama3 and qwen3 can); set parallelism.pp = 1"
            )
        layout = pipelined(layout, config, model.n_blocks)
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
    if spec.planning.block_activations is None:
        raise ConfigError(
            f"model '{config.model.name}' has no activation estimate (ModelSpec.planning.block_activations)"
        )
    if dims.cp_enabled and not spec.capabilities.context_parallel:
        raise ConfigError(
            f"parallelism.cp = {dims.cp}: model {config.model.name} has no context-parallel attention "
            "(llama3 and qwen3 have); set parallelism.cp = 1"
        )
    args = model.args
    head = lm_head_bytes(args.vocab_size, args.dim, geometry) if work.unit == "tokens" else (0.0, 0.0)
    block = spec.planning.block_activations(args, geometry)
    if dims.cp_enabled:
        block = with_gathered_kv(block, args.n_kv_heads * args.attn_head_dim, geometry, dims.cp)
    ac, offloaded = config.activation_checkpoint, parallelism.fsdp_cpu_offload
    if layout.pipeline is not None:
        pipeline = layout.pipeline

        def rank_plan(rank: int) -> MemoryPlan:
            share = rank_share(pipeline, rank)
            local = rank_census(config, model, pipeline, rank)
            activations = pipeline_activations(block, pipeline, share, geometry, ac, head)
            if dims.cp_enabled:
                activations = with_mask(activations, work.tokens_per_sample, dims.cp)
            buffers = pipeline_buffer_bytes(local, layout.precision) if dims.fsdp_enabled else None
            memory = estimate_memory(local, activations, layout.precision, dims.fsdp_enabled, buffers, offloaded)
            moved = _offloaded_per_microbatch(block.checkpointed, geometry, offloaded_blocks(ac, share))
            return MemoryPlan(layout, model, work, activations, memory, local, rank, moved)

        ranks = most_loaded_candidates(dims.pp) if pp_rank is None else (pp_rank,)
        return max((rank_plan(rank) for rank in ranks), key=lambda plan: plan.memory.total)
    activations = estimate_activations(block, model.n_blocks, geometry, ac, head)
    if dims.cp_enabled:
        activations = with_mask(activations, work.tokens_per_sample, dims.cp)
    memory = estimate_memory(model, activations, layout.precision, dims.fsdp_enabled, offloaded=offloaded)
    whole = RankShare(0, (0,), model.n_blocks, True, True)
    moved = _offloaded_per_microbatch(block.checkpointed, geometry, offloaded_blocks(ac, whole))
    return MemoryPlan(layout, model, work, activations, memory, model, 0, moved)


def full_finetuning_memory(config: TrainConfig, devices: int) -> MemoryEstimate:
    """A LoRA run's memory per device had it trained every parameter instead, on the same layout: the
    figure its report puts beside its own."""
    return plan_memory(dataclasses.replace(config, lora=LoRAConfig()), devices).memory


def _offloaded_per_microbatch(checkpointed: float, geometry: Geometry, blocks: int) -> int:
    """Bytes activation offload moves to host memory per micro-batch: each offloaded block's input."""
    return int(checkpointed * geometry.tokens * blocks)


def make_plan(
    config: TrainConfig, cluster: Cluster, compute_efficiency: float = COMPUTE_EFFICIENCY, census_of: CensusOf = census
) -> Plan:
    detail = plan_memory(config, cluster.devices, census_of)
    layout, model, work = detail.layout, detail.local, detail.workload
    dims, args = layout.dims, model.args
    # The trainer's rule on TPUs (titan_tpu/distributed/topology.py): only the outermost axis crosses
    # DCN, pp when there is one, else dp_replicate.
    outer, outer_degree = ("pp", dims.pp) if dims.pp_enabled else ("dp_replicate", dims.dp_replicate)
    if cluster.chip.fast_link == "ICI" and outer_degree % cluster.slices:
        raise ConfigError(
            f"parallelism.{outer}: {cluster.name} is {cluster.slices} slices and only {outer} "
            f"crosses slices (over DCN), so {outer} must be a multiple of {cluster.slices}"
        )
    ac, pipeline = config.activation_checkpoint, layout.pipeline
    if pipeline is None:
        recomputed = ac.recomputed_blocks(model.n_blocks)
        bubble, sent = 1.0, 0.0
    else:
        share = rank_share(pipeline, detail.pp_rank)
        recomputed = len(share.stages) * ac.recomputed_blocks(share.layers_per_stage)
        bubble = step_time_factor(pipeline.schedule, dims.pp, pipeline.microbatches, len(share.stages))
        tokens = work.tokens_per_sample // dims.cp  # a stage passes on its cp rank's part of the rows
        sent = p2p_bytes(pipeline, layout.micro_batch, tokens, args.dim, layout.precision.compute_bytes)
    routing = get_model_spec(config.model.name).planning.expert_routing
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
        recomputed_blocks=recomputed,
        reshard=config.parallelism.fsdp_reshard_after_forward,
        cp=dims.cp,
        kv_dim=args.n_kv_heads * args.attn_head_dim if dims.cp_enabled else 0,
        reductions=None if pipeline is None else 1,
        pp=dims.pp,
        bubble=bubble,
        p2p_bytes=sent,
        pp_spans_slices=dims.pp_enabled and cluster.slices > 1,
    )
    host_link_s, host_s = host_seconds(detail, shape, config, cluster)
    items = config.training.global_batch_size * work.items_per_sample
    step = estimate_step(
        model,
        shape,
        layout.precision,
        cluster,
        work.flops_per_item,
        work.block_forward_flops_per_item,
        items,
        compute_efficiency,
        work.tp_replicated_flops_per_item,
        host_link_s,
        host_s,
    )
    fit = check_fit(detail.memory, cluster.hbm_bytes_per_device)
    return Plan(config, cluster, detail, fit, step, compute_efficiency, shape)


def host_seconds(detail: MemoryPlan, shape: StepShape, config: TrainConfig, cluster: Cluster) -> tuple[float, float]:
    """(host-link seconds overlapped with compute, exposed host seconds) of one step (host_offload.py)."""
    overlapped = exposed = 0.0
    if config.parallelism.fsdp_cpu_offload and detail.layout.dims.fsdp_enabled:
        # Every unit but the last block and the root is gathered twice per micro-batch (once with "never").
        gathers = shape.grad_accum * (1 if shape.reshard == "never" else 2)
        to_device, to_host = fsdp_offload_bytes(detail.local.local, gathers, shape.gradient_reductions)
        overlapped += host_link_seconds(to_device + to_host, cluster)
        exposed += host_optimizer_seconds(detail.local.local)
    if detail.offloaded_per_microbatch:
        moved = detail.offloaded_per_microbatch * shape.grad_accum
        overlapped += host_link_seconds(moved, cluster)  # out in forward, non-blocking
        exposed += host_link_seconds(moved, cluster)  # back when backward needs it
    return overlapped, exposed
