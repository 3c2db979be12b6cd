"""How the experts' matmuls run (`GroupedExperts`' impl) as a measured choice (see
titan_tpu/protocols/tunable.py): padded batched matmuls, the ragged grouped matmul where it runs (and
TorchTPU's ragged_dot on TPU), or the per-expert loop. Which wins depends on the device, the dtype,
the expert widths and how evenly tokens spread over the experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.func import functional_call

from titan_tpu.models.qwen3.args import ExpertImpl
from titan_tpu.models.qwen3.moe import GroupedExperts
from titan_tpu.protocols.tunable import KernelRun, KernelShape, Tunable, forward_backward

# The correctness check's token count per rank: every expert gets a run of a few tokens.
CHECK_TOKENS = 512


def _widths(args: Any, shape: KernelShape) -> tuple[int, int, int]:
    """(dim, expert hidden width, experts) on one rank."""
    return args.dim, args.moe_hidden_dim // shape.tp, args.num_experts // shape.ep


def _candidates(args: Any, shape: KernelShape) -> dict[str, str]:
    names = ["padded_bmm", "loop"]
    dim, hidden, _ = _widths(args, shape)
    # torch._grouped_mm needs 16-byte aligned rows, and torch.compile takes it in bf16 only: it is a
    # candidate in bf16, where it is also the GPUs' fast path.
    aligned = all(width * 2 % 16 == 0 for width in (dim, hidden))
    if shape.dtype == torch.bfloat16 and aligned:
        names.append("grouped_mm")
    # TorchTPU's ragged grouped matmul, as attention's splash kernel: a candidate on TPU only.
    if shape.device.type == "tpu" and shape.ragged_dot_op is not None:
        names.append("ragged_dot")
    return {name: name for name in names}


def _bind_ragged_dot(args: Any, shape: KernelShape) -> Any:
    """`args` with the device's ragged_dot op when expert_impl names it; refused off TPU."""
    if args.expert_impl != "ragged_dot":
        return args
    if shape.ragged_dot_op is None:
        raise ValueError(
            f"model.moe_impl = 'ragged_dot' runs TorchTPU's torch.tpu.ops.ragged_dot, which "
            f"this {shape.device.type} run does not have; use auto, grouped_mm, padded_bmm or loop"
        )
    return dataclasses.replace(args, ragged_dot_op=shape.ragged_dot_op)


def _tokens(args: Any, shape: KernelShape) -> int:
    """Rows the experts of one layer see on a rank: every token of the micro-batch, top_k times."""
    return shape.batch * shape.seq_len * args.top_k


def _workload(args: Any, shape: KernelShape) -> KernelRun:
    dim, hidden, experts = _widths(args, shape)
    rows = _tokens(args, shape)
    generator = torch.Generator().manual_seed(0)
    # Skewed routing, expert e drawing a share proportional to 1 / (e + 1): padded_bmm pays for
    # experts x the longest run, so balanced routing would flatter it, and a router is far from
    # balanced early in training (on the debug MoE, balanced routing timed padded_bmm level with
    # grouped_mm, which trains it 1.49x faster: docs/benchmarks/kernels_epyc_2026-12-03.md).
    shares = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
    choices = torch.multinomial(shares, rows, replacement=True, generator=generator)
    counts = torch.bincount(choices, minlength=experts)
    x = torch.randn(rows, dim, generator=generator)
    module = GroupedExperts(dim, hidden, experts, "loop", ragged_dot_op=shape.ragged_dot_op)
    weights = {name: torch.randn(p.shape, generator=generator) * 0.02 for name, p in module.named_parameters()}
    device_counts = counts.to(shape.device)

    def run(impl: ExpertImpl, dtype: torch.dtype) -> list[torch.Tensor]:
        module.impl = impl

        def experts_out(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
            return functional_call(module, {"w1": w1, "w2": w2, "w3": w3}, (x, device_counts))

        inputs = (x, weights["w1"], weights["w2"], weights["w3"])
        return forward_backward(experts_out, *(t.to(device=shape.device, dtype=dtype) for t in inputs))

    return run


def _check_shape(shape: KernelShape) -> KernelShape:
    seq_len = max(1, min(shape.seq_len, CHECK_TOKENS))
    return dataclasses.replace(shape, batch=1, seq_len=seq_len)


def _key(args: Any, shape: KernelShape) -> tuple[int, ...]:
    return (_tokens(args, shape), *_widths(args, shape))


EXPERTS = Tunable(
    field="expert_impl",
    is_auto=lambda args: args.expert_impl == "auto",
    candidates=_candidates,
    reference="loop",
    fallback="padded_bmm",
    workload=_workload,
    check_shape=_check_shape,
    key=_key,
    config_override=lambda name: f"--model.moe_impl={name}",
    name_of=lambda args: args.expert_impl,
    float32_inputs_under_autocast=True,
    bind_device_op=_bind_ragged_dot,
)
