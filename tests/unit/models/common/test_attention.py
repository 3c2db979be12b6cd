"""Every attention kernel computes causal attention as the reference math does, forward and backward;
the splash seam hands the TPU op what it expects; blocked attention keeps O(S) for backward; the
automatic choice follows its rule."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from titan_tpu.models.common.attention import Attention
from titan_tpu.models.common.attention_kernels import (
    AutoAttention,
    BlockedAttention,
    SdpaAttention,
    SplashAttention,
    attention_kernel,
    requested_attention,
)
from titan_tpu.models.common.attention_tunable import ATTENTION
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.protocols.attention import AttentionKernel
from titan_tpu.protocols.tunable import KernelShape


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, future_visible: int = 0) -> torch.Tensor:
    """Softmax(q k^T / sqrt(D) + causal mask) v in float64, kv heads repeated per group.
    `future_visible` > 0 lets each query see that many future keys: a wrong mask for negative controls."""
    n_rep = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(n_rep, dim=1)
    v64 = v.double().repeat_interleave(n_rep, dim=1)
    scores = q.double() @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seqlen = q.shape[2]
    allowed = torch.ones(seqlen, seqlen, dtype=torch.bool).tril(diagonal=future_visible)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v64).to(q.dtype)


def splash_stand_in(calls: list[dict[str, Any]]) -> Callable[..., torch.Tensor]:
    """A function with torch.tpu.ops.splash_sdpa's calling convention that records its calls and
    computes the reference math, refusing a wrong enable_gqa the way the real op does."""

    def splash_sdpa(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        is_causal: bool = True,
        enable_gqa: bool = False,
        **blocks: int,
    ) -> torch.Tensor:
        if enable_gqa != (q.shape[1] != k.shape[1]):
            raise ValueError("enable_gqa does not match inputs")
        calls.append(
            dict(shapes=(q.shape, k.shape, v.shape), scale=scale, is_causal=is_causal, enable_gqa=enable_gqa, **blocks)
        )
        return reference_attention(q, k, v)

    return splash_sdpa


KERNELS: dict[str, Callable[[], AttentionKernel]] = {
    "sdpa": SdpaAttention,
    "blocked:128": lambda: BlockedAttention(128),
    "blocked:64": lambda: BlockedAttention(64),
    "blocked:16": lambda: BlockedAttention(16),
}
# (batch, query heads, kv heads, sequence): one block or several, ragged last block, MHA / GQA / MQA.
SHAPES = [(2, 3, 3, 7), (2, 4, 2, 128), (1, 4, 2, 300), (2, 4, 1, 97)]


def _qkv(batch: int, heads: int, kv_heads: int, seqlen: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seqlen, 32, requires_grad=True)
    k = torch.randn(batch, kv_heads, seqlen, 32, requires_grad=True)
    v = torch.randn(batch, kv_heads, seqlen, 32, requires_grad=True)
    return q, k, v


def _forward_backward(
    fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_kernel_matches_reference_forward_and_backward(kernel_name: str, shape: tuple[int, ...]) -> None:
    # Catches a wrong mask on the diagonal block, a lost ragged last block, a misrouted GQA group, a
    # softmax-backward slip (the blocked kernel's hand-written backward) and a wrong scale.
    q, k, v = _qkv(*shape)
    grad_out = torch.randn_like(q)
    expected = _forward_backward(reference_attention, q, k, v, grad_out)
    actual = _forward_backward(KERNELS[kernel_name](), q, k, v, grad_out)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_comparison_rejects_a_wrong_mask() -> None:
    # Negative control: one visible future key changes outputs and gradients beyond the tolerance.
    q, k, v = _qkv(1, 4, 2, 300)
    grad_out = torch.randn_like(q)
    leaky = _forward_backward(lambda *t: reference_attention(*t, future_visible=1), q, k, v, grad_out)
    blocked = _forward_backward(BlockedAttention(64), q, k, v, grad_out)
    for got, leaked in zip(blocked, leaky):
        assert not torch.allclose(got, leaked, atol=1e-3)


def test_blocked_attention_keeps_no_quadratic_activations_for_backward() -> None:
    # Catches a regression to autograd-recorded blocks, which keep every block's probabilities
    # (O(S^2)); the reference math shows the measurement sees such tensors.
    q, k, v = _qkv(1, 4, 2, 512)

    def saved_bytes(fn: Callable[..., torch.Tensor]) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v)
        return sum(sizes)

    one_score_matrix = 4 * 512 * 512 * 4  # heads x S x S float32
    linear_bound = 4 * q.numel() * 4  # q, k, v and out
    assert saved_bytes(BlockedAttention(64)) <= linear_bound
    assert saved_bytes(reference_attention) > one_score_matrix


@pytest.mark.parametrize("heads, kv_heads, seqlen, block", [(4, 2, 384, 128), (4, 4, 1024, 512), (4, 1, 256, 256)])
def test_splash_seam_routes_unrepeated_kv_and_flags(heads: int, kv_heads: int, seqlen: int, block: int) -> None:
    calls: list[dict[str, Any]] = []
    kernel = attention_kernel("splash", splash_op=splash_stand_in(calls))
    q, k, v = _qkv(1, heads, kv_heads, seqlen)
    torch.testing.assert_close(kernel(q, k, v), reference_attention(q, k, v))
    (call,) = calls
    assert call["shapes"] == (q.shape, k.shape, v.shape)  # [B, H, S, D] and [B, H_kv, S, D], not repeated
    assert call["is_causal"] and call["enable_gqa"] == (heads != kv_heads)
    assert call["scale"] == pytest.approx(32**-0.5)
    assert {call[name] for name in ("block_q", "block_kv", "block_kv_compute", "block_dkv")} == {block}


def test_splash_refuses_lengths_it_cannot_tile() -> None:
    kernel = attention_kernel("splash", splash_op=splash_stand_in([]))
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel(*_qkv(1, 2, 2, 200))


def test_splash_keywords_bind_to_the_installed_op() -> None:
    # Catches a keyword the adapter passes that the installed torch_tpu's splash_sdpa does not take.
    splash_module = pytest.importorskip("torch_tpu._internal.ops.splash_attention")
    calls: list[dict[str, Any]] = []
    attention_kernel("splash", splash_op=splash_stand_in(calls))(*_qkv(1, 4, 2, 256))
    keywords = {name: value for name, value in calls[0].items() if name != "shapes"}
    q, k, v = _qkv(1, 4, 2, 256)
    inspect.signature(splash_module.splash_sdpa).bind(q, k, v, **keywords)


@dataclass(frozen=True)
class ReferenceKernel:
    """The float64 reference math as a kernel, so every named kernel (SDPA too) is compared with it."""

    name: str = "reference"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return reference_attention(q, k, v)


@pytest.mark.parametrize("kernel_name", ["sdpa", "blocked:32", "splash"])
def test_attention_layer_output_does_not_depend_on_the_kernel(kernel_name: str) -> None:
    torch.manual_seed(0)
    reference = Attention(
        dim=64, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, norm_eps=1e-6, kernel=ReferenceKernel()
    )
    kernel = attention_kernel(kernel_name, splash_op=splash_stand_in([]))
    layer = Attention(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True, norm_eps=1e-6, kernel=kernel)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(2, 128, 64)
    angles = torch.randn(128, 8)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    torch.testing.assert_close(layer(x, cos, sin), reference(x, cos, sin), atol=1e-5, rtol=1e-5)


def test_kernel_names() -> None:
    assert attention_kernel("blocked:96") == BlockedAttention(96)
    assert attention_kernel("sdpa").name == "sdpa"
    assert isinstance(attention_kernel("splash", splash_op=splash_stand_in([])), SplashAttention)
    for bad in ("flash", "blocked:", "blocked:0", "blocked:x"):
        with pytest.raises(ValueError, match="known: auto, sdpa, blocked:<block>, splash"):
            attention_kernel(bad)
    with pytest.raises(ValueError, match="needs the TPU op"):
        attention_kernel("splash")


def test_attention_block_names_the_kernel_and_auto_has_candidates_per_device() -> None:
    """-1 leaves the kernel to measurement (titan_tpu/autotune/) among the device's candidates."""
    assert requested_attention(-1) == AutoAttention()
    assert requested_attention(0).name == "sdpa" and requested_attention(64).name == "blocked:64"
    with pytest.raises(ValueError, match="-1 \\(auto\\), 0 \\(SDPA\\)"):
        requested_attention(-2)

    def candidates(device: str, seq_len: int = 2048, splash: bool = False) -> list[str]:
        shape = KernelShape(
            SimpleNamespace(type=device), torch.bfloat16, 1, seq_len, splash_op=splash_stand_in([]) if splash else None
        )
        return list(ATTENTION.candidates(LLAMA3_FLAVORS["debug"], shape))

    assert candidates("cpu") == ["sdpa", "blocked:64", "blocked:128", "blocked:256", "blocked:512"]
    assert candidates("cpu", seq_len=100) == ["sdpa", "blocked:64"]
    assert candidates("tpu", splash=True) == ["sdpa", "splash"]
    assert candidates("tpu", seq_len=1000, splash=True) == ["sdpa"]  # no 128-multiple tiles
    assert candidates("tpu") == ["sdpa"]  # no splash op (no jax)
    assert candidates("cuda") == ["sdpa"]  # SDPA is the GPUs' flash kernel
