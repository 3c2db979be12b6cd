"""A dry run's measured collective bytes turned into a step's communication seconds, on the planner's
own link model (titan_tpu/plan/roofline.py), so that a curve drawn from them differs from the
planner's only where the traffic torch issues differs from the traffic the planner counts.

The dry run (titan_tpu/dryrun) records one micro-batch: every row is repeated for each of the step's
micro-batches (`StepShape.grad_accum`), FSDP's reduce-scatters for each gradient reduction
(`StepShape.gradient_reductions`, one per micro-batch unless pipelined), as the planner counts them.
A row's bytes are the whole buffer (titan_tpu/dryrun/collectives.py); a ring moves (n - 1) / n of them
over each device's links, twice that for an all-reduce, an all-to-all's routed bytes too (the planner's
expert-parallel model). Each group runs at the planner's bandwidth for the devices it is laid across:
tp innermost, then ep or cp, then dp_shard (titan_tpu/distributed/parallel_dims.py), so an axis's
groups span its own size times that of every axis inside it.
"""

from __future__ import annotations

from collections.abc import Iterable

from titan_tpu.dryrun.report import CollectiveRow
from titan_tpu.plan.chips import Cluster
from titan_tpu.plan.roofline import ALL_REDUCE, ALL_TO_ALL, GATHER_SCATTER, StepShape, group_bandwidth, ring_factor

# The StepEstimate fields measured traffic replaces; the others (P2P, host) stay the planner's.
FIELDS = ("fsdp_s", "hsdp_s", "tp_s", "ep_s", "cp_s")
# The axes FSDP shards over: dp_shard, flattened with cp, the experts' share of it under ep, or the
# default group when dp_shard alone spans every rank (titan_tpu/dryrun/collectives.py `group_axes`).
FSDP_AXES = ("dp_shard", "dp_shard_cp", "dp_shard_mod_ep", "world")
# kind -> (ring passes, the collectives whose bandwidth it runs at)
_KINDS: dict[str, tuple[int, tuple[str, ...]]] = {
    "all_gather": (1, GATHER_SCATTER),
    "reduce_scatter": (1, GATHER_SCATTER),
    "all_reduce": (2, ALL_REDUCE),
    "all_to_all": (1, ALL_TO_ALL),
}


def axis_placement(axis: str, shape: StepShape) -> tuple[str, int]:
    """(the StepEstimate field an axis's traffic counts in, the devices one of its groups spans);
    the spans are those of the planner's `fsdp_seconds`, `tp_seconds`, `ep_seconds`, `cp_seconds`
    and `hsdp_seconds`."""
    if axis == "tp":
        return "tp_s", shape.tp
    if axis == "ep":
        return "ep_s", shape.ep * shape.tp
    if axis == "cp":
        return "cp_s", shape.cp * shape.tp
    if axis in FSDP_AXES:
        return "fsdp_s", shape.dp_shard * shape.tp  # dp_shard counts the cp ranks (StepShape)
    if axis == "dp_replicate":
        return "hsdp_s", shape.devices // shape.pp
    # Pipeline sends and any axis added later: refused rather than silently left out of the step.
    raise ValueError(f"collectives over mesh axis '{axis}' have no place in the planner's step model")


def step_seconds(rows: Iterable[CollectiveRow], shape: StepShape, cluster: Cluster) -> dict[str, float]:
    """Seconds of one step by StepEstimate field, from one micro-batch's collectives."""
    seconds = dict.fromkeys(FIELDS, 0.0)
    for row in rows:
        if row.bytes == 0:  # barriers
            continue
        if row.kind not in _KINDS:
            raise ValueError(f"{row.kind} over '{row.axis}': no ring model for this kind of collective")
        passes, link_kinds = _KINDS[row.kind]
        field, span = axis_placement(row.axis, shape)
        gradients = row.kind == "reduce_scatter" and row.axis in FSDP_AXES
        repeats = shape.gradient_reductions if gradients else shape.grad_accum
        moved = repeats * passes * ring_factor(row.group_size) * row.bytes
        seconds[field] += moved / group_bandwidth(cluster, span, link_kinds)
    return seconds
