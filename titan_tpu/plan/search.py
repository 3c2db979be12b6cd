"""`--search`: every layout of a config on a cluster that the planner can tell apart, ranked by MFU.

The levers, each an override train.py takes: dp_replicate (multiples of the slice count), tp (1, 2,
4, 8), ep (MoE only, powers of two), dp_shard (what the others leave), the micro-batch
(`training.local_batch_size`, powers of two dividing each rank's share of the global batch),
activation checkpointing (none, selective per op, selective every 2nd block, full; per op and full
also with offload) and the gradient reduction dtype under bf16. Layouts the trainer would
refuse (heads or experts that do not divide, a batch that does not split) are skipped the way the
trainer refuses them. Among equal MFUs the search prefers float32 reduction and no offload: they
cost nothing in the planner's model, but bf16 reduction changes the numbers (README, Parallelism)
and offload moves memory over the host link, whose time the planner does not charge.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from titan_tpu import models
from titan_tpu.config import ConfigError, TrainConfig
from titan_tpu.distributed.parallel_dims import ParallelDims
from titan_tpu.plan.census import Census, census, run_model_args
from titan_tpu.plan.chips import Cluster
from titan_tpu.plan.planner import Plan, make_plan

TP_DEGREES = (1, 2, 4, 8)
EP_DEGREES = (1, 2, 4, 8, 16, 32, 64)
# Data-parallel replicas per slice tried: HSDP inside a slice trades all-gather group size for memory.
REPLICAS_PER_SLICE = (1, 2, 4, 8)
# (mode, selective_option, offload)
CHECKPOINTING = (
    ("none", "2", False),
    ("selective", "op", False),
    ("selective", "2", False),
    ("full", "2", False),
    ("selective", "op", True),
    ("full", "2", True),
)


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # ready to paste after train.py's --config
    plan: Plan


def _powers_of_two_dividing(value: int) -> list[int]:
    return [1 << k for k in range(value.bit_length()) if value % (1 << k) == 0]


def _layouts(config: TrainConfig, cluster: Cluster) -> Iterator[tuple[int, int, int, int, int]]:
    """(dp_replicate, dp_shard, tp, ep, micro-batch) that divide the cluster and the global batch;
    the config's parallelism.cp is kept, and takes its share of the devices first."""
    devices, global_batch = cluster.devices // config.parallelism.cp, config.training.global_batch_size
    routing = models.get_model_spec(config.model.name).expert_routing
    is_moe = routing is not None and routing(run_model_args(config)).top_k > 0
    for tp, per_slice, ep in itertools.product(TP_DEGREES, REPLICAS_PER_SLICE, EP_DEGREES if is_moe else (1,)):
        replicate = per_slice * cluster.slices
        if devices % (replicate * tp):
            continue
        shard = devices // (replicate * tp)
        if shard % ep or global_batch % (replicate * shard):
            continue
        for micro in _powers_of_two_dividing(global_batch // (replicate * shard)):
            yield replicate, shard, tp, ep, micro


def _variants(config: TrainConfig, cluster: Cluster) -> Iterator[tuple[tuple[str, ...], TrainConfig]]:
    reduces = ("float32", "bfloat16") if config.training.dtype != "float32" else ("float32",)
    for (replicate, shard, tp, ep, micro), (mode, option, offload), reduce in itertools.product(
        _layouts(config, cluster), CHECKPOINTING, reduces
    ):
        overrides = (
            f"--parallelism.dp_replicate={replicate}", f"--parallelism.dp_shard={shard}",
            f"--parallelism.tp={tp}", f"--parallelism.ep={ep}", f"--training.local_batch_size={micro}",
            f"--activation_checkpoint.mode={mode}", f"--activation_checkpoint.selective_option={option}",
            f"--activation_checkpoint.offload={str(offload).lower()}", f"--parallelism.fsdp_reduce_dtype={reduce}",
        )  # fmt: skip
        yield overrides, dataclasses.replace(
            config,
            parallelism=dataclasses.replace(
                config.parallelism, dp_replicate=replicate, dp_shard=shard, tp=tp, ep=ep, fsdp_reduce_dtype=reduce
            ),
            training=dataclasses.replace(config.training, local_batch_size=micro),
            activation_checkpoint=dataclasses.replace(
                config.activation_checkpoint, mode=mode, selective_option=option, offload=offload
            ),
        )


def search(config: TrainConfig, cluster: Cluster, compute_efficiency: float) -> tuple[list[Candidate], Candidate | None]:
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

    for overrides, variant in _variants(config, cluster):
        try:
            plan = make_plan(variant, cluster, compute_efficiency, cached_census)
        except ConfigError:
            continue  # a layout the trainer refuses
        candidate = Candidate(overrides, plan)
        if plan.fit.fits:
            fitting.append(candidate)
        elif closest is None or plan.fit.margin > closest.plan.fit.margin:
            closest = candidate
    fitting.sort(key=_rank)
    return _distinct(fitting), (None if fitting else closest)


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """The best-ranked of each layout that differs only in offload and reduce dtype: the others would
    fill the list with copies at the same MFU."""
    seen: set[tuple[object, ...]] = set()
    kept = []
    for candidate in ranked:
        config, layout = candidate.plan.config, candidate.plan.detail.layout
        ac = config.activation_checkpoint
        key = (layout.dims, layout.micro_batch, ac.mode, ac.selective_option)
        if key not in seen:
            seen.add(key)
            kept.append(candidate)
    return kept


def _rank(candidate: Candidate) -> tuple[float, bool, bool]:
    variant = candidate.plan.config
    return (
        -round(candidate.plan.step.mfu, 4),
        variant.activation_checkpoint.offload,
        variant.parallelism.fsdp_reduce_dtype != "float32",
    )
