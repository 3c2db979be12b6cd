"""What the planner (`python -m titan_tpu.plan`) asks a model family through its `ModelSpec`, so a new
family is planned without the planner knowing it: the bytes one block keeps for backward, how its
tokens are routed through experts, and its tensor-parallel plan as data; and what it asks a task: the
workload of one step.

Plain arithmetic and types; nothing here builds or runs a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

FLOAT32 = 4  # bytes: norms, softmaxes and the router keep float32 whatever the compute dtype


class ActivationGeometry(Protocol):
    """What a block's activations per token depend on (the planner's `Geometry` is one)."""

    @property
    def act_bytes(self) -> int:
        """Bytes per element of the compute dtype."""
        ...

    @property
    def tp(self) -> int: ...

    @property
    def t_sp(self) -> int:
        """tp with sequence parallelism (the residual stream is split over the sequence), else 1."""
        ...


@dataclass(frozen=True)
class BlockActivations:
    """Bytes per token one block holds, by activation-checkpointing mode."""

    full: float  # everything a non-checkpointed block keeps
    selective_op: float  # kept under op-level selective checkpointing
    checkpointed: float  # a checkpointed block's input
    # What the block's backward holds beyond its activations: the gradients of its widest intermediate,
    # of its output (arriving) and of its input (leaving).
    backward: float


@dataclass(frozen=True)
class ExpertRouting:
    """A mixture-of-experts family's routing, for the planner's step time."""

    top_k: int  # experts each token is sent to, in every MoE block
    # Training FLOPs per token of the MoE layers (router and the top_k experts of every layer): they
    # are not tensor-parallel, so every tp rank repeats them.
    training_flops_per_token: float


class TensorParallelPlan(Protocol):
    """A family's tensor-parallel plan as data: module path in the (unwrapped) model -> the
    `torch.distributed.tensor.parallel` style the family's `parallelize` gives it, or, for a bare
    parameter the plan splits, the `Shard` placement of it. The planner reads which weights it
    splits, and along which dimension, from these styles. A plan that `parallelize` would refuse for
    `tp` ranks raises the same ConfigError here."""

    def styles(self, model: nn.Module, tp: int, sequence_parallel: bool, loss_parallel: bool) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Workload:
    """What one training step of a task computes, as the planner needs it; each task says
    (`TrainingTask.planned_workload`), from the config and the model's arguments alone."""

    unit: str  # "tokens" or "samples", as the trainer reports throughput
    items_per_sample: int
    tokens_per_sample: int  # sequence length the activations scale with
    flops_per_item: float  # training (forward + backward) FLOPs
    # Forward FLOPs of the repeated blocks per item: what recomputing every block costs.
    block_forward_flops_per_item: float
    # Training FLOPs per item that every tensor-parallel rank repeats: a mixture-of-experts layer is
    # not tensor-parallel, so each of the tp ranks routes and runs the same tokens through it.
    tp_replicated_flops_per_item: float = 0.0
