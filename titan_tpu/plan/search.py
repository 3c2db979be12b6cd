"""`--search`: every layout of a config on a cluster that the planner can tell apart, ranked by MFU.

The levers, each an override train.py takes: pipeline parallelism (pp 1, 2, 4, 8, 16; schedules 1F1B
and Interleaved1F1B; pp_microbatches 1, 2 or 4 per stage, where the local batch divides), context
parallelism (cp 1, 2, 4, for families with context-parallel attention), dp_replicate (multiples of
the slice count; with pp, pp spans the slices instead), tp (1, 2, 4, 8), ep (MoE only, powers of
two), dp_shard (what the others leave), the micro-batch (`training.local_batch_size`, powers of two
dividing each rank's share of the global batch; under pp the schedule's micro-batches instead),
activation checkpointing (none, selective per op, selective every 2nd block, full; per op and full
also with activation offload), FSDP CPU offload, and the gradient reduction dtype under bf16.
Layouts the trainer would refuse (heads or experts that do not divide, a batch that does not split,
pp or cp with what they are not built for: the trainer's own `check_pipeline_parallel`,
`check_context_parallel` and `plan_pipeline`) are skipped the way the trainer refuses them.

Speed: one census per mesh (cached), and an offload (FSDP CPU or activation) variant is planned only
when the same layout without it does not fit: offload only adds host time, so where the plain layout
fits it is at least as fast. Among equal MFUs the search prefers fewer levers: no FSDP CPU offload,
pp 1, cp 1, no activation offload, float32 reduction (bf16 reduction changes the numbers: README,
Parallelism).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.config.sections import CheckpointMode, PipelineSchedule, ReduceDtype
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.models.registry import get_model_spec
from titan_tpu.plan.census import Census, census, run_model_args
from titan_tpu.plan.chips import Cluster
from titan_tpu.plan.pipeline_bubble import stages_per_rank
from titan_tpu.plan.planner import Plan, make_plan

TP_DEGREES = (1, 2, 4, 8)
EP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
PP_DEGREES = (1, 2, 4, 8, 16)
PP_SCHEDULES: tuple[PipelineSchedule, ...] = ("1F1B", "Interleaved1F1B")
MICROBATCHES_PER_STAGE = (1, 2, 4)
CP_DEGREES = (1, 2, 4)
# Data-parallel replicas per slice tried: HSDP inside a slice trades all-gather group size for memory.
REPLICAS_PER_SLICE = (1, 2, 4, 8)
# (mode, selective_option, activation offload); each offloading entry follows the same mode without.
CHECKPOINTING: tuple[tuple[CheckpointMode, str, bool], ...] = (
    ("none", "2", False),
    ("selective", "op", False),
    ("selective", "op", True),
    ("selective", "2", False),
    ("full", "2", False),
    ("full", "2", True),
)


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # ready to paste after train.py's --config
    plan: Plan


@dataclass(frozen=True)
class Mesh:
    replicate: int
    shard: int
    tp: int
    ep: int
    cp: int
    pp: int


@dataclass(frozen=True)
class Batching:
    local_batch_size: int  # -1 under pp
    schedule: PipelineSchedule
    microbatches: int  # -1 without pp


def _powers_of_two_dividing(value: int) -> list[int]:
    return [1 << k for k in range(value.bit_length()) if value % (1 << k) == 0]


def _meshes(config: TrainConfig, cluster: Cluster) -> Iterator[Mesh]:
    """Degrees whose product is the cluster's devices and whose data-parallel ranks split the global
    batch; ep only without cp (the trainer does not build that combination)."""
    global_batch = config.training.global_batch_size
    spec = get_model_spec(config.model.name)
    routing = spec.planning.expert_routing
    is_moe = routing is not None and routing(run_model_args(config)).top_k > 0
    for pp, cp in itertools.product(PP_DEGREES, CP_DEGREES if spec.capabilities.context_parallel else (1,)):
        if (pp > 1 and pp % cluster.slices) or cluster.devices % (pp * cp):
            continue
        devices = cluster.devices // (pp * cp)
        slices = cluster.slices if pp == 1 else 1  # with pp, pp is the axis that spans slices
        for tp, per_slice, ep in itertools.product(
            TP_DEGREES, REPLICAS_PER_SLICE, EP_DEGREES if is_moe and cp == 1 else (1,)
        ):
            replicate = per_slice * slices
            if devices % (replicate * tp):
                continue
            shard = devices // (replicate * tp)
            if shard % ep or global_batch % (replicate * shard):
                continue
            yield Mesh(replicate, shard, tp, ep, cp, pp)


def _batchings(config: TrainConfig, mesh: Mesh) -> Iterator[Batching]:
    local = config.training.global_batch_size // (mesh.replicate * mesh.shard)
    if mesh.pp == 1:
        for micro in _powers_of_two_dividing(local):
            yield Batching(micro, config.parallelism.pp_schedule, -1)
        return
    for schedule, per_stage in itertools.product(PP_SCHEDULES, MICROBATCHES_PER_STAGE):
        microbatches = mesh.pp * stages_per_rank(schedule) * per_stage
        if local % microbatches == 0:
            yield Batching(-1, schedule, microbatches)


def _variant(
    config: TrainConfig,
    mesh: Mesh,
    batching: Batching,
    checkpointing: tuple[CheckpointMode, str, bool],
    reduce: ReduceDtype,
    fsdp_offload: bool,
) -> tuple[tuple[str, ...], TrainConfig]:
    mode, option, offload = checkpointing
    overrides = (
        f"--parallelism.dp_replicate={mesh.replicate}",
        f"--parallelism.dp_shard={mesh.shard}",
        f"--parallelism.tp={mesh.tp}",
        f"--parallelism.ep={mesh.ep}",
        f"--parallelism.cp={mesh.cp}",
        f"--parallelism.pp={mesh.pp}",
        f"--parallelism.pp_schedule={batching.schedule}",
        f"--parallelism.pp_microbatches={batching.microbatches}",
        f"--training.local_batch_size={batching.local_batch_size}",
        f"--activation_checkpoint.mode={mode}",
        f"--activation_checkpoint.selective_option={option}",
        f"--activation_checkpoint.offload={str(offload).lower()}",
        f"--parallelism.fsdp_reduce_dtype={reduce}",
        f"--parallelism.fsdp_cpu_offload={str(fsdp_offload).lower()}",
    )
    return overrides, dataclasses.replace(
        config,
        parallelism=dataclasses.replace(
            config.parallelism,
            dp_replicate=mesh.replicate,
            dp_shard=mesh.shard,
            tp=mesh.tp,
            ep=mesh.ep,
            cp=mesh.cp,
            pp=mesh.pp,
            pp_schedule=batching.schedule,
            pp_microbatches=batching.microbatches,
            pp_layers_per_stage=-1,
            fsdp_reduce_dtype=reduce,
            fsdp_cpu_offload=fsdp_offload,
        ),
        training=dataclasses.replace(config.training, local_batch_size=batching.local_batch_size),
        activation_checkpoint=dataclasses.replace(
            config.activation_checkpoint, mode=mode, selective_option=option, offload=offload
        ),
    )


def search(
    config: TrainConfig, cluster: Cluster, compute_efficiency: float
) -> tuple[list[Candidate], Candidate | None]:
    """(the layouts that fit, best first; the one that misses by the least, when none fits)."""
    fitting: list[Candidate] = []
    closest: Candidate | None = None
    censuses: dict[ParallelDims, Census | ConfigError] = {}

    def cached_census(variant: TrainConfig, dims: ParallelDims) -> Census:
        # The model is the same in every variant (only the layout changes): one census per layout,
        # or the refusal of that layout (heads or experts that do not divide).
        if dims not in censuses:
            try:
                censuses[dims] = census(variant, dims)
            except ConfigError as refusal:
                censuses[dims] = refusal
        found = censuses[dims]
        if isinstance(found, ConfigError):
            raise found
        return found

    def planned(overrides: tuple[str, ...], variant: TrainConfig) -> Candidate | None:
        nonlocal closest
        try:
            plan = make_plan(variant, cluster, compute_efficiency, cached_census)
        except ConfigError:
            return None  # a layout the trainer refuses
        candidate = Candidate(overrides, plan)
        if plan.fit.fits:
            fitting.append(candidate)
        elif closest is None or plan.fit.margin > closest.plan.fit.margin:
            closest = candidate
        return candidate

    reduces: tuple[ReduceDtype, ...] = ("float32", "bfloat16") if config.training.dtype != "float32" else ("float32",)
    for mesh in _meshes(config, cluster):
        for batching in _batchings(config, mesh):
            for reduce in reduces:
                bare_fits = False  # the checkpointing mode without any offload fits
                for checkpointing in CHECKPOINTING:
                    if checkpointing[2] and bare_fits:
                        continue  # the same mode fits without activation offload, which only adds time
                    for fsdp_offload in (False, True):
                        candidate = planned(*_variant(config, mesh, batching, checkpointing, reduce, fsdp_offload))
                        fits = candidate is not None and candidate.plan.fit.fits
                        if not checkpointing[2] and not fsdp_offload:
                            bare_fits = fits
                        if fits or mesh.replicate * mesh.shard * mesh.cp == 1:
                            break  # it fits without FSDP CPU offload, or there is no FSDP to offload
    fitting.sort(key=_rank)
    return _distinct(fitting), (None if fitting else closest)


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """The best-ranked of each layout that differs only in offloads and reduce dtype: the others would
    fill the list with copies at the same MFU."""
    seen: set[tuple[object, ...]] = set()
    kept = []
    for candidate in ranked:
        config, layout = candidate.plan.config, candidate.plan.detail.layout
        ac = config.activation_checkpoint
        key = (layout.dims, layout.micro_batch, layout.pipeline, ac.mode, ac.selective_option)
        if key not in seen:
            seen.add(key)
            kept.append(candidate)
    return kept


def _rank(candidate: Candidate) -> tuple[float, bool, bool, bool, bool, bool]:
    variant = candidate.plan.config
    parallelism = variant.parallelism
    return (
        -round(candidate.plan.step.mfu, 4),
        parallelism.fsdp_cpu_offload,
        parallelism.pp > 1,
        parallelism.cp > 1,
        variant.activation_checkpoint.offload,
        parallelism.fsdp_reduce_dtype != "float32",
    )
