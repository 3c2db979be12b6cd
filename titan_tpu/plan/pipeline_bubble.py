"""The pipeline bubble: how much longer a step of `parallelism.pp` stages takes than the same work
with no idle time (titan_tpu/distributed/pipeline.py runs the schedules).

With p pipeline ranks, m micro-batches and v stages per rank, and every stage's forward and
backward of one micro-batch taking the same time, a step lasts m + (p - 1) / v micro-batch slots
instead of m (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021, section 2.2: the bubble of GPipe and 1F1B is (p - 1) / m of the ideal
time; interleaving v stages per rank divides it by v). The zero-bubble schedule splits each
backward into its input gradient (B) and weight gradient (W) and fills the bubble with the W passes;
with equal F, B and W times its bubble is a third of 1F1B's (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, section 3: ZB-H1, (p - 1)(T_F + T_B - T_W) against 1F1B's
(p - 1)(T_F + T_B + T_W)).

What this leaves out: the activations sent between stages (point-to-point, micro_batch x seq x dim
each way per stage boundary) are charged by the roofline, not here; unequal stages (the first holds
the embedding, the last the head and the loss) lengthen every slot to the slowest stage's.
"""

from __future__ import annotations

from titan_tpu.distributed.pipeline_plan import stages_per_rank

__all__ = ["bubble_fraction", "bubble_slots", "stages_per_rank", "step_time_factor"]

ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble",)
# ZB-H1's bubble against 1F1B's with equal forward, input-gradient and weight-gradient times.
ZERO_BUBBLE_FRACTION = 1 / 3


def bubble_slots(schedule: str, pp: int, microbatches: int, per_rank: int) -> float:
    """Idle micro-batch slots of one step: (p - 1) / v, a third of that for zero-bubble schedules."""
    if pp < 1 or microbatches < 1 or per_rank < 1:
        raise ValueError(f"pp ({pp}), microbatches ({microbatches}) and per_rank ({per_rank}) must be >= 1")
    slots = (pp - 1) / per_rank
    return slots * ZERO_BUBBLE_FRACTION if schedule in ZERO_BUBBLE_SCHEDULES else slots


def step_time_factor(schedule: str, pp: int, microbatches: int, per_rank: int) -> float:
    """A pipelined step's time over the same compute with no bubble: (m + bubble slots) / m."""
    return (microbatches + bubble_slots(schedule, pp, microbatches, per_rank)) / microbatches


def bubble_fraction(schedule: str, pp: int, microbatches: int, per_rank: int) -> float:
    """The share of a pipelined step each rank spends idle: bubble slots / (m + bubble slots)."""
    slots = bubble_slots(schedule, pp, microbatches, per_rank)
    return slots / (microbatches + slots)
