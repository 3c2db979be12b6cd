"""A kernel decision a model leaves to measurement: what a run's "auto" may become, and how to time it.

A family lists its tunables on its `ModelSpec`; the engine (titan_tpu/autotune/) times every candidate
at the run's shapes, checks it against a float32 reference, and writes the fastest correct one into
the model arguments before the model is built. The model code only says what the candidates are and
how one forward and backward of them runs: it measures nothing and knows no device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KernelShape:
    """What a kernel is measured at: this rank's share of one micro-batch."""

    device: torch.device
    dtype: torch.dtype  # the run's compute dtype
    batch: int  # sequences per micro-batch on this rank
    seq_len: int
    # The run computes under autocast (one process in bf16: float32 weights and residual stream,
    # matmuls cast), not with bf16 weights (FSDP's mixed precision) or in float32.
    autocast: bool = False
    tp: int = 1  # tensor-parallel degree: heads and expert widths are split by it
    ep: int = 1  # expert-parallel degree: experts are split by it
    # Packed documents are kept apart (data.document_mask): attention takes document ids.
    document_mask: bool = False
    # The task's loss is the chunked cross-entropy (always eager, also in compiled runs; see
    # loss_tunable.py): not on vocab-sharded logits (which take F.cross_entropy), not another task's.
    eager_loss: bool = True
    # The TPU's splash attention op, when the device has it (the device layer hands it in).
    splash_op: Callable[..., torch.Tensor] | None = None
    # The TPU's ragged grouped matmul (torch.tpu.ops.ragged_dot), handed in the same way.
    ragged_dot_op: Callable[..., torch.Tensor] | None = None


# run(value, dtype) -> the output and the input gradients of one forward and backward, with `value`
# (a candidate) in the model; inputs are made once, from a fixed seed, and handed over in `dtype`.
KernelRun = Callable[[Any, torch.dtype], list[torch.Tensor]]


@dataclass(frozen=True)
class Tunable:
    """One model-args field whose "auto" value is decided by measurement.

    `candidates(args, shape)`: name -> value for the field, in preference order (the first is what a
    tie keeps). `reference`: the candidate whose float32 result every candidate is checked against.
    `fallback`: the value deterministic runs use, since a timing can differ between two runs.
    `workload(args, shape)`: the run at these shapes; `check_shape(shape)` the smaller shape the
    correctness check runs at. `float32_inputs_under_autocast`: in an autocast run the inputs arrive
    in float32 (the experts read the residual stream's norm), not in the compute dtype (attention
    reads the projections' autocast outputs); the measurement hands them over as the run would. `key(args, shape)`: the facts the best choice depends on (the cache
    key, with the device's). `bind_device_op(args, shape)`: for a field whose value runs an op of the
    device (a string naming it in the config), `args` with that op from `shape` put beside it, or a
    ValueError (one line) when the value asks for an op this device lacks; applied to the value the
    config forced and to the one measured alike.
    """

    field: str
    is_auto: Callable[[Any], bool]
    candidates: Callable[[Any, KernelShape], dict[str, Any]]
    reference: str
    fallback: str
    workload: Callable[[Any, KernelShape], KernelRun]
    check_shape: Callable[[KernelShape], KernelShape]
    key: Callable[[Any, KernelShape], tuple[int, ...]]
    # The train.py override that forces a candidate (scripts/bench.py --kernels runs each one).
    config_override: Callable[[str], str]
    # The name of the value the field holds: what the log says a config forced.
    name_of: Callable[[Any], str]
    float32_inputs_under_autocast: bool = False
    bind_device_op: Callable[[Any, KernelShape], Any] | None = None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| over the whole tensor (L2), in float32."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-30))


def forward_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    """fn(*inputs) and the gradient of a fixed random projection of it to every input."""
    inputs = tuple(x.detach().requires_grad_() for x in inputs)
    out = fn(*inputs)
    generator = torch.Generator(device=out.device).manual_seed(1)
    projection = torch.randn(out.shape, generator=generator, device=out.device, dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, projection)
    return [out.detach(), *grads]
