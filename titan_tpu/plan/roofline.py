"""Step time and MFU of a run on a cluster, from FLOPs and bytes moved (a roofline, not a simulation).

Compute: the step's model FLOPs per device (the family's FLOPs-per-item function times the items of
the global batch, divided over the devices, as the trainer's MFU counts them) plus what activation
checkpointing recomputes (the blocks' forward again for each checkpointed block) and what tp ranks
repeat (a mixture-of-experts layer runs whole on every tp rank), at
`COMPUTE_EFFICIENCY` of the device's dense bf16 peak.

Communication, per micro-batch, ring collectives: a device receives (n - 1) / n of the gathered
bytes in an all-gather or reduce-scatter over n devices, twice that in an all-reduce.

- FSDP over dp_shard: every unit (block, experts, root) is all-gathered (at FSDP2's padded size:
  every shard as large as the largest) in the compute dtype for
  forward and again for backward unless it stays gathered (the last block and the root under the
  default policy; none with "never"; all with "always"), and its gradients are reduce-scattered
  in the reduce dtype. Experts are gathered over dp_shard / ep.
- HSDP: the sharded gradients are all-reduced over dp_replicate (across slices, over DCN).
- Tensor parallelism: each dense block all-gathers its input and reduce-scatters its output around
  attention and feed-forward (4 collectives of micro_batch x seq x dim activations forward, 4
  backward; an MoE block 3 + 3, its feed-forward is not tensor-parallel), again for a recomputed
  block's forward but its last (checkpoint early stop, `tp_collectives`); the embedding's output
  and the head's input, forward and backward, and without loss parallelism the logits.
- Expert parallelism: each MoE block sends every token's top-k copies out and back (all-to-all, the
  (ep - 1) / ep that leave the device), forward, backward and recompute.
- Context parallelism (titan_tpu/distributed/context_parallel.py): each block's attention
  all-gathers the keys and values of the whole sequence over cp (micro_batch x seq x 2 kv_dim / tp
  elements gathered) in forward and again for a recomputed block, and reduce-scatters their
  gradients in backward; blocking, so exposed.

A collective whose group fits inside a slice (TPU) or NVLink domain (GPU) runs at the fast links'
bandwidth (`chips.py`), otherwise at DCN / InfiniBand's, each at `COLLECTIVE_EFFICIENCY`. Groups are
laid out innermost first: tp, then ep or cp, then dp_shard, then dp_replicate.

With a doctor report (`--calibration`, `calibration.py`) the measured figures replace the vendor's:
compute runs at the measured matmul FLOP/s of the plan's dtype (still at the compute efficiency:
a step's smaller matmuls and other ops lose against one large square matmul), and each collective
at the bus bandwidth measured for its kind on that link (the slowest axis measured; nothing further
derated: a measured bus bandwidth already is what the ring reaches). MFU still divides by the
table's peak, as the trainer's does.

Pipeline parallelism (pipeline.py): compute is stretched by the bubble (`pipeline_bubble.py`
`step_time_factor`); FSDP gathers per micro-batch but reduces (and HSDP all-reduces) once per step,
after the last micro-batch; the activations and gradients sent between stages are exposed (P2P).
Host memory (host_offload.py): FSDP CPU offload's copies and activation offload's forward copies run
on the host link beside compute (host link, overlapped); activation offload's copies back and the
host optimizer step are exposed (host).

Overlap: FSDP and HSDP collectives run on other links while the device computes and are prefetched,
so they cost only what exceeds compute; tensor- and expert-parallel collectives sit on the critical
path (the next op needs their result) and add to it:

    step = max(compute x bubble, FSDP, HSDP, host link) + TP + EP + CP + P2P + host
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_tpu.plan.census import ROOT, Census
from titan_tpu.plan.chips import Cluster
from titan_tpu.plan.memory import Precision

# Fraction of peak FLOP/s a transformer step's matmuls sustain when nothing waits on communication.
# An assumption, not a measurement: published large-model MFUs on TPUs and GPUs reach 50-70% *with*
# communication and recomputation included; `--efficiency` changes it.
COMPUTE_EFFICIENCY = 0.75
# Fraction of link bandwidth ring collectives reach (NCCL's and XLA's large-message bus bandwidth).
COLLECTIVE_EFFICIENCY = 0.8


@dataclass(frozen=True)
class StepShape:
    """How the run splits its work, per device."""

    devices: int
    dp_shard: int
    dp_replicate: int
    tp: int
    ep: int
    micro_batch: int  # samples per forward pass
    grad_accum: int
    tokens_per_sample: int
    dim: int
    vocab: int  # 0 for models without an LM head
    loss_parallel: bool
    moe_top_k: int  # 0 for dense models
    n_blocks: int
    recomputed_blocks: int  # blocks whose forward runs twice
    reshard: str  # FSDP policy: default, always, never
    cp: int = 1
    kv_dim: int = 0  # n_kv_heads x head_dim of attention (before tp), for context parallelism
    reductions: int | None = None  # gradient reductions per step; None: one per micro-batch
    pp: int = 1
    bubble: float = 1.0  # pipeline_bubble.step_time_factor
    p2p_bytes: float = 0.0  # sent between pipeline stages per step by one device
    pp_spans_slices: bool = False  # pp is the axis that crosses slices (over DCN)

    @property
    def gradient_reductions(self) -> int:
        return self.grad_accum if self.reductions is None else self.reductions


@dataclass(frozen=True)
class StepEstimate:
    compute_s: float
    fsdp_s: float
    hsdp_s: float
    tp_s: float
    ep_s: float
    useful_flops_per_device: float
    peak_flops: float
    cp_s: float = 0.0
    bubble: float = 1.0  # compute_s is without it
    p2p_s: float = 0.0
    host_link_s: float = 0.0  # overlapped with compute
    host_s: float = 0.0  # exposed: copies back that nothing prefetches, the host optimizer step

    @property
    def step_s(self) -> float:
        overlapped = max(self.compute_s * self.bubble, self.fsdp_s, self.hsdp_s, self.host_link_s)
        return overlapped + self.tp_s + self.ep_s + self.cp_s + self.p2p_s + self.host_s

    @property
    def mfu(self) -> float:
        return self.useful_flops_per_device / (self.step_s * self.peak_flops)


def ring_factor(n: int) -> float:
    """The share of a collective's buffer a ring moves over each device's links, for n devices."""
    return (n - 1) / n if n > 1 else 0.0


# The collectives each kind of traffic runs (the doctor's names for them).
GATHER_SCATTER = ("all_gather", "reduce_scatter")
ALL_REDUCE = ("all_reduce",)
ALL_TO_ALL = ("all_to_all",)


def assumed_bus_bandwidth(cluster: Cluster, fast: bool, kinds: tuple[str, ...] = ()) -> float:
    """Bus bandwidth (bytes/s a device receives, the ring model's rate) of `kinds` of collective on
    the fast or the slow links: the calibration's slowest measured kind where it has one, else the
    vendor's per-device figure at COLLECTIVE_EFFICIENCY."""
    calibration = cluster.calibration
    measured = calibration.bus_bytes_per_s.get("fast" if fast else "slow", {}) if calibration else {}
    known = [measured[kind] for kind in kinds if kind in measured]
    if known:
        return min(known)
    per_device = cluster.fast_bytes_per_s_per_device() if fast else cluster.slow_bytes_per_s_per_device()
    return per_device * COLLECTIVE_EFFICIENCY


def group_bandwidth(cluster: Cluster, span: int, kinds: tuple[str, ...]) -> float:
    """Bytes/s a device receives in a collective over a group laid out across `span` devices."""
    return assumed_bus_bandwidth(cluster, span <= cluster.devices_per_slice, kinds)


def compute_flops(cluster: Cluster, precision: Precision) -> float:
    """FLOP/s the matmuls run at before the compute efficiency: the calibration's measured matmul
    rate in the plan's dtype, else the table's bf16 peak."""
    dtype = "bfloat16" if precision.compute_bytes == 2 else "float32"
    calibration = cluster.calibration
    if calibration is not None and dtype in calibration.matmul_flops:
        return calibration.matmul_flops[dtype]
    return cluster.peak_flops_per_device


def _regathered(unit: str, is_last_block: bool, reshard: str) -> bool:
    if reshard == "default":
        return unit != ROOT and not is_last_block
    return reshard == "always"


@dataclass(frozen=True)
class UnitTraffic:
    """One FSDP unit's collectives in one step: whole buffers, at FSDP2's padded sizes (the dry
    run's convention, titan_tpu/dryrun/collectives.py)."""

    degree: int  # ranks the unit is sharded over
    gathers: int
    gathered_bytes: int  # all-gather outputs, all of the step's
    reductions: int
    reduced_bytes: int  # reduce-scatter inputs, all of the step's


def fsdp_traffic(census: Census, shape: StepShape, precision: Precision) -> dict[str, UnitTraffic]:
    """Every FSDP unit's all-gathers and reduce-scatters of one step, by unit."""
    units = census.units()
    blocks = [name for name in units if name != ROOT and not name.endswith(".experts")]
    traffic: dict[str, UnitTraffic] = {}
    for name, params in units.items():
        gathered = sum(p.gathered_numel for p in params)
        reduced = sum(p.gathered_numel for p in params if p.trainable)  # a LoRA run's base has no gradient
        block = name.removesuffix(".experts")
        gathers = shape.grad_accum * (
            2 if _regathered(name, bool(blocks) and block == blocks[-1], shape.reshard) else 1
        )
        reductions = shape.gradient_reductions if reduced else 0
        traffic[name] = UnitTraffic(
            params[0].fsdp_degree,
            gathers,
            gathers * precision.compute_bytes * gathered,
            reductions,
            reductions * precision.reduce_bytes * reduced,
        )
    return traffic


def fsdp_seconds(census: Census, shape: StepShape, precision: Precision, cluster: Cluster) -> float:
    """All-gathers and reduce-scatters of one step over dp_shard."""
    moved = sum(
        ring_factor(unit.degree) * (unit.gathered_bytes + unit.reduced_bytes)
        for unit in fsdp_traffic(census, shape, precision).values()
    )
    return moved / group_bandwidth(cluster, shape.dp_shard * shape.tp, GATHER_SCATTER)


def hsdp_seconds(census: Census, shape: StepShape, precision: Precision, cluster: Cluster) -> float:
    trained = sum(p.local_numel for p in census.trained)
    moved = 2 * ring_factor(shape.dp_replicate) * trained * precision.reduce_bytes
    # The data-parallel groups lie inside one pp coordinate.
    return shape.gradient_reductions * moved / group_bandwidth(cluster, shape.devices // shape.pp, ALL_REDUCE)


def p2p_seconds(shape: StepShape, cluster: Cluster) -> float:
    """The activations and gradients one device sends to the next and previous stage (pipeline.py)."""
    if shape.pp == 1:
        return 0.0
    return shape.p2p_bytes / assumed_bus_bandwidth(cluster, not shape.pp_spans_slices)


def tp_collectives(shape: StepShape) -> int:
    """Tensor-parallel all-gathers and reduce-scatters of one micro-batch, as the dry run counts
    them (titan_tpu/dryrun): each block's forward and backward; a recomputed block's forward again
    but its last collective, because torch's checkpoint stops recomputing once every tensor its
    backward saved is back (`torch.utils.checkpoint` early stop, on by default), before the
    reduce-scatter of the block's output; the embedding's output and the head's input, forward
    and backward; without loss parallelism the logits' gather."""
    per_block = 3 if shape.moe_top_k else 4  # collectives per forward pass of a block
    logits = 0 if shape.loss_parallel else 1
    return per_block * 2 * shape.n_blocks + (per_block - 1) * shape.recomputed_blocks + 4 + logits


def tp_seconds(shape: StepShape, precision: Precision, cluster: Cluster) -> float:
    if shape.tp == 1:
        return 0.0
    activation = shape.micro_batch * shape.tokens_per_sample * shape.dim * precision.compute_bytes
    if shape.loss_parallel:
        moved: float = tp_collectives(shape) * activation
    else:  # the logits' gather moves vocab-wide rows
        moved = (tp_collectives(shape) - 1) * activation + activation / shape.dim * shape.vocab
    return shape.grad_accum * ring_factor(shape.tp) * moved / group_bandwidth(cluster, shape.tp, GATHER_SCATTER)


def ep_seconds(shape: StepShape, precision: Precision, cluster: Cluster) -> float:
    if shape.ep == 1 or not shape.moe_top_k:
        return 0.0
    routed = shape.micro_batch * shape.tokens_per_sample * shape.moe_top_k * shape.dim * precision.compute_bytes
    # Dispatch and combine, forward and backward, and forward again for a recomputed block.
    all_to_alls = 2 * (2 * shape.n_blocks + shape.recomputed_blocks)
    bandwidth = group_bandwidth(cluster, shape.ep * shape.tp, ALL_TO_ALL)
    return shape.grad_accum * ring_factor(shape.ep) * routed * all_to_alls / bandwidth


def cp_seconds(shape: StepShape, precision: Precision, cluster: Cluster) -> float:
    """The K/V all-gathers (forward, recompute) and gradient reduce-scatters (backward) over cp;
    `shape.tokens_per_sample` is a device's share, 1 / cp of the sequence."""
    if shape.cp == 1:
        return 0.0
    gathered = shape.micro_batch * shape.tokens_per_sample * shape.cp * 2 * shape.kv_dim / shape.tp
    collectives = 2 * shape.n_blocks + shape.recomputed_blocks
    bandwidth = group_bandwidth(cluster, shape.cp * shape.tp, GATHER_SCATTER)
    return shape.grad_accum * ring_factor(shape.cp) * gathered * precision.compute_bytes * collectives / bandwidth


def estimate_step(
    census: Census,
    shape: StepShape,
    precision: Precision,
    cluster: Cluster,
    flops_per_item: float,
    block_forward_flops_per_item: float,
    items_per_step: int,
    compute_efficiency: float = COMPUTE_EFFICIENCY,
    tp_replicated_flops_per_item: float = 0.0,
    host_link_s: float = 0.0,
    host_s: float = 0.0,
) -> StepEstimate:
    peak = cluster.peak_flops_per_device
    useful = flops_per_item * items_per_step / shape.devices
    recompute = block_forward_flops_per_item * items_per_step / shape.devices * shape.recomputed_blocks / shape.n_blocks
    repeated = tp_replicated_flops_per_item * items_per_step / shape.devices * (shape.tp - 1)
    return StepEstimate(
        compute_s=(useful + recompute + repeated) / (compute_flops(cluster, precision) * compute_efficiency),
        fsdp_s=fsdp_seconds(census, shape, precision, cluster),
        hsdp_s=hsdp_seconds(census, shape, precision, cluster),
        tp_s=tp_seconds(shape, precision, cluster),
        ep_s=ep_seconds(shape, precision, cluster),
        useful_flops_per_device=useful,
        peak_flops=peak,
        cp_s=cp_seconds(shape, precision, cluster),
        bubble=shape.bubble,
        p2p_s=p2p_seconds(shape, cluster),
        host_link_s=host_link_s,
        host_s=host_s,
    )
