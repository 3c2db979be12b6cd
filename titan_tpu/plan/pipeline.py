"""Pipeline parallelism (`parallelism.pp`) in the planner: what the most loaded pp rank holds, and
what crossing the stage boundaries costs. The bubble itself is `pipeline_bubble.py`.

Stages: the trainer's own split (titan_tpu/distributed/pipeline_plan.py `plan_pipeline`, called
here, so the planner refuses what the trainer refuses) and its own cut of the meta model
(titan_tpu/distributed/pipeline.py `stage_models`): a rank holds the blocks of its stages, the
embedding with the first stage, the final norm and the head with the last. FSDP shards them over
dp_shard within the rank's pp coordinate, as without pp (census.py).

Gathered parameters and gradients under FSDP: torch.distributed.pipelining (torch 2.13, stage.py
`backward_maybe_with_nosync`) runs every micro-batch's backward with `set_requires_gradient_sync(False)`
and `set_reshard_after_backward(False)`, and reduce-scatters once after the last micro-batch
(`perform_reduce_grad`). So every FSDP unit of the rank stays gathered from its backward on (the next
forward reshards it, its backward gathers it again), and its unsharded gradient (in the reduce dtype,
`FSDPParam.to_accumulated_grad_if_needed`) is held across the step: on top of the sharded state the
rank holds its stages' parameters whole in the compute dtype and their gradients whole in the reduce
dtype (`pipeline_buffer_bytes`). Across micro-batches that is ZeRO-1, not ZeRO-3.

Activations: the schedule splits each data-parallel rank's batch (global batch / dp) into
pp_microbatches micro-batches. A "chunk" is one micro-batch through one stage (its layers, counted by
`activations.py` at the micro-batch's size). A rank keeps every chunk whose forward ran and whose
backward has not; the most of them it holds is the forwards it runs before its first backward, plus
one (torch 2.13 schedules.py, rank r of p, m micro-batches, v stages per rank):

- GPipe: every forward first, m v chunks;
- 1F1B (`Schedule1F1B`, warmup min(m, p - r) forwards, then a backward first): min(m, p - r);
- Interleaved1F1B (`_get_warmup_ops`): min((v - 1) m_round + 2 (p - 1 - r), m v) forwards of warmup,
  m_round = m / max(1, m // p) micro-batches per round, then one forward before the first backward;
  InterleavedZeroBubble the same with (p - 1 - r) instead of 2 (p - 1 - r) (its weight-gradient
  passes, deferred into the bubble, keep part of a chunk longer: not counted).

The peak is all but one of those chunks kept plus one chunk's forward-and-backward peak (the head's
loss backward with it on the rank holding the last stage; under GPipe every chunk of the last stage
also keeps the head's logits). Rank 0 keeps the most chunks and the embedding, rank pp - 1 the head
and the loss: the ranks between hold fewer chunks of the same blocks and no root parameters, so the
most loaded rank is one of those two (`most_loaded_candidates`).

Time: compute per rank times `step_time_factor` (the bubble); each micro-batch's activation crosses
every stage boundary forward and its gradient backward (micro_batch x seq x dim in the compute dtype;
not divided by tp: counted as if every tp rank sent the whole activation), so a rank sends 2 v m of
them per step. A stage waits for its input (torch posts the receive and waits on it before the
forward or backward that needs it), so the transfers are charged exposed. They run over ICI inside a
slice and over DCN when pp spans slices (pp is the outermost mesh axis, the one that crosses slices:
titan_tpu/distributed/topology.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from titan_tpu.config import TrainConfig
from titan_tpu.config.sections import ActivationCheckpointConfig
from titan_tpu.distributed.pipeline import stage_models
from titan_tpu.distributed.pipeline_plan import MULTI_STAGE_SCHEDULES, PipelinePlan, plan_pipeline
from titan_tpu.plan.activations import ActivationEstimate, Geometry, estimate_activations
from titan_tpu.plan.census import Census, meta_model
from titan_tpu.plan.memory import Precision
from titan_tpu.plan.pipeline_bubble import ZERO_BUBBLE_SCHEDULES
from titan_tpu.protocols.planning import BlockActivations


def most_loaded_candidates(pp: int) -> tuple[int, ...]:
    """The pp ranks one of which holds the most: the first and the last (see the module doc)."""
    return (0, pp - 1)


def pipeline_of(config: TrainConfig, n_layers: int, dp: int) -> PipelinePlan:
    """The trainer's stages and micro-batches for `config` (pp > 1) with `dp` data-parallel ranks."""
    return plan_pipeline(config.parallelism, n_layers, config.training.global_batch_size // dp)


@dataclass(frozen=True)
class RankShare:
    """What one pp rank runs."""

    rank: int
    stages: tuple[int, ...]
    layers_per_stage: int
    holds_first: bool
    holds_last: bool

    @property
    def layers(self) -> int:
        return self.layers_per_stage * len(self.stages)


def rank_share(plan: PipelinePlan, rank: int) -> RankShare:
    stages = tuple(plan.stages_of_rank(rank))
    return RankShare(rank, stages, len(plan.stage_layers[0]), 0 in stages, plan.n_stages - 1 in stages)


@functools.lru_cache(maxsize=64)
def _rank_parameter_names(model_name: str, args: Any, plan: PipelinePlan, rank: int) -> frozenset[str]:
    """The names of the parameters pp rank `rank` holds, from the trainer's own cut of the meta model
    (cached: a search plans the same split many times)."""
    meta = meta_model(model_name, args)
    stages = stage_models(meta, plan, rank, f"model {model_name}")
    return frozenset(name for _, stage in stages for name, _ in stage.named_parameters())


def rank_census(config: TrainConfig, census: Census, plan: PipelinePlan, rank: int) -> Census:
    """`census` cut down to the parameters pp rank `rank` holds; n_blocks becomes its layers."""
    names = _rank_parameter_names(config.model.name, census.args, plan, rank)
    params = tuple(p for p in census.params if p.name in names)
    return Census(census.args, params, rank_share(plan, rank).layers)


def pipeline_buffer_bytes(census: Census, precision: Precision) -> int:
    """Under FSDP: the rank's parameters gathered whole in the compute dtype and their gradients
    unsharded in the reduce dtype, held across the step (see the module doc)."""
    gathered = sum(p.tp_numel for p in census.params)
    return gathered * (precision.compute_bytes + precision.reduce_bytes)


def in_flight_chunks(schedule: str, pp: int, microbatches: int, per_rank: int, rank: int) -> int:
    """The most chunks (one micro-batch through one stage) pp rank `rank` keeps at once."""
    m, v, p = microbatches, per_rank, pp
    if schedule == "GPipe":
        return m * v
    if schedule not in MULTI_STAGE_SCHEDULES:  # 1F1B
        return min(m, p - rank)
    per_round = m // max(1, m // p)
    hops = (p - 1 - rank) * (1 if schedule in ZERO_BUBBLE_SCHEDULES else 2)
    warmup = min((v - 1) * per_round + hops, m * v)
    return min(warmup + 1, m * v)


def pipeline_activations(
    block: BlockActivations,
    plan: PipelinePlan,
    share: RankShare,
    g: Geometry,
    ac: ActivationCheckpointConfig,
    head: tuple[float, float],
) -> ActivationEstimate:
    """The rank's activation bytes: its chunks in flight, at the pipeline micro-batch `g`."""
    chunks = in_flight_chunks(plan.schedule, plan.pp, plan.microbatches, len(share.stages), share.rank)
    body = estimate_activations(block, share.layers_per_stage, g, ac)
    last = estimate_activations(block, share.layers_per_stage, g, ac, head) if share.holds_last else body
    other = last if plan.schedule == "GPipe" else body
    return ActivationEstimate((chunks - 1) * other.kept + last.kept, (chunks - 1) * other.kept + last.peak)


def offloaded_blocks(ac: ActivationCheckpointConfig, share: RankShare) -> int:
    """Blocks whose checkpointed input activation offload moves, counted per stage as the trainer
    wraps them (each stage's blocks from index 0)."""
    if not ac.offload:
        return 0
    return len(share.stages) * sum(ac.wraps_block(index) for index in range(share.layers_per_stage))


def p2p_bytes(plan: PipelinePlan, micro_batch: int, tokens_per_sample: int, dim: int, act_bytes: int) -> float:
    """Bytes one pp rank sends per step: every micro-batch's activation forward and gradient backward
    for each of its stages."""
    per_rank = len(plan.stages_of_rank(0))
    return 2 * per_rank * plan.microbatches * micro_batch * tokens_per_sample * dim * act_bytes
