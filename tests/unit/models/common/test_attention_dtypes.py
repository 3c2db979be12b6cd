"""Every attention kernel is correct for every dtype combination autograd can hand it: activations in
bf16 or float32, or mixed as autocast leaves them (Qwen 3's QK-norm has a float32 weight, so under
bf16 autocast q and k arrive in float32 beside a bf16 v), an incoming gradient in another dtype than
the output, with and without autocast. These run on every CPU kind whatever `auto` picks there;
shapes are tiny so bf16 stays fast where it is emulated.

Bug caught: the blocked kernel's backward multiplied a bf16 copy of the probabilities with a float32
incoming gradient (`expected scalar type Float but found BFloat16`), which crashed GRPO on CPUs with
native bf16.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from titan_tpu.models.common.attention_kernels import BlockedAttention, SdpaAttention
from titan_tpu.protocols.attention import AttentionKernel

KERNELS: dict[str, Callable[[], AttentionKernel]] = {
    "sdpa": SdpaAttention,
    "blocked:16": lambda: BlockedAttention(16),  # three blocks, the last ragged
}
F32, BF16 = torch.float32, torch.bfloat16
# Twice the largest error measured against the float64 reference (outputs and gradients alike, both
# kernels): float32 1.3e-6; bf16 2.9e-2, from rounding the probabilities and the score gradients. A
# wrong mask errs by 2.9 (the negative control).
TOLERANCE = {F32: 3e-6, BF16: 6e-2}


def _inputs(qk_dtype: torch.dtype, v_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Leaf q [2, 4, 40, 16] and GQA k, v [2, 2, 40, 16] in the dtypes given."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 16, generator=g).to(qk_dtype).requires_grad_()
    k = torch.randn(2, 2, 40, 16, generator=g).to(qk_dtype).requires_grad_()
    v = torch.randn(2, 2, 40, 16, generator=g).to(v_dtype).requires_grad_()
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, future_visible: int = 0) -> torch.Tensor:
    """Causal attention in float64 (kv heads repeated per group); `future_visible` > 0 lets each query
    see that many future keys, a wrong mask for the negative control."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(diagonal=future_visible)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    compute: torch.dtype,
    grad_out: torch.Tensor,
    future_visible: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Output and input gradients of the float64 reference on the inputs rounded to `compute`."""
    leaves = [t.detach().to(compute).double().requires_grad_() for t in (q, k, v)]
    out = reference(*leaves, future_visible=future_visible)
    return (out, *torch.autograd.grad(out, leaves, grad_out.double()))


def _run(
    kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_dtype: torch.dtype, autocast: bool
) -> tuple[torch.Tensor, ...]:
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        out = kernel(q, k, v)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(grad_dtype)
    # Backward runs outside autocast, as the trainer's does.
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out), grad_out)


def _assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tolerance: float) -> None:
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, atol=tolerance, rtol=tolerance, msg=lambda m, n=name: f"{n}: {m}")


# (autocast, q and k dtype, v dtype): outside autocast mixed inputs are refused (the last test).
CASES = [(False, F32, F32), (False, BF16, BF16), (True, F32, F32), (True, BF16, BF16), (True, F32, BF16)]


@pytest.mark.parametrize("grad_dtype", [F32, BF16], ids=["grad_f32", "grad_bf16"])
@pytest.mark.parametrize(
    "autocast, qk_dtype, v_dtype", CASES, ids=["f32", "bf16", "autocast_f32", "autocast_bf16", "autocast_qk_f32_v_bf16"]
)
@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_forward_and_backward_in_every_dtype_combination(
    kernel_name: str, autocast: bool, qk_dtype: torch.dtype, v_dtype: torch.dtype, grad_dtype: torch.dtype
) -> None:
    q, k, v = _inputs(qk_dtype, v_dtype)
    compute = BF16 if autocast else qk_dtype
    *got, grad_out = _run(KERNELS[kernel_name](), q, k, v, grad_dtype, autocast)
    # The output is in the compute dtype (what SDPA gives under autocast); each gradient in its input's.
    assert got[0].dtype == compute
    assert [g.dtype for g in got[1:]] == [q.dtype, k.dtype, v.dtype]
    _assert_close(tuple(got), _expected(q, k, v, compute, grad_out), TOLERANCE[compute])


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_bf16_tolerance_rejects_a_wrong_mask(kernel_name: str) -> None:
    # Negative control: at the bf16 tolerance, one visible future key is still caught.
    q, k, v = _inputs(F32, BF16)
    *got, grad_out = _run(KERNELS[kernel_name](), q, k, v, F32, autocast=True)
    with pytest.raises(AssertionError):
        _assert_close(tuple(got), _expected(q, k, v, BF16, grad_out, future_visible=1), TOLERANCE[BF16])


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_mixed_inputs_outside_autocast_are_refused(kernel_name: str) -> None:
    # Both kernels follow SDPA's rule, so a model runs with either or with neither.
    q, k, v = _inputs(F32, BF16)
    with pytest.raises((RuntimeError, ValueError), match="dtype"):
        KERNELS[kernel_name]()(q, k, v)
